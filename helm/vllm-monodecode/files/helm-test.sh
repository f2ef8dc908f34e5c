# `helm test`: does the release serve a completion with mono decode? Plain sh + wget + awk (a
# busybox image runs it).
#  1. wait until /health answers and /metrics carries every series `monodecode-ops verify
#     --endpoint` requires;
#  2. send one completion to /v1/completions (with API_KEY as a bearer token when set);
#  3. pass when mono decode ran decode steps for it, or, where the values allow stock decode
#     (EXPECT), when the exported state says why it did not.
# EXPECT: mono (monodecode.on_refusal raise), mono-or-refused (on_refusal degrade: a start-up
# refusal with its reason in monodecode_refusal_info is fine), disabled (monodecode.enabled false).
# Usage: sh -c "$(cat helm-test.sh)" helm-test BASE_URL MODEL EXPECT TIMEOUT_SECONDS
base="$1"
model="$2"
expect="$3"
timeout="$4"
required="monodecode_enabled monodecode_steps_total monodecode_fallback_steps_total monodecode_step_duration_seconds monodecode_failstop_total"
scrape=/tmp/metrics
deadline=$(( $(date +%s) + timeout ))

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

fetch_metrics() {
  timeout 10 wget -q -O "$scrape" "$base/metrics"
}

# sum of a counter's samples whose line matches a label pattern, e.g. path="mono"
counter() {
  awk -v name="$1" -v pat="$2" 'index($0, name "{") == 1 && (pat == "" || index($0, pat)) { s += $NF } END { printf "%d\n", s }' "$scrape"
}

# 1. ready, and the plugin's series are there
while :; do
  if timeout 10 wget -q -O /tmp/health "$base/health" && fetch_metrics; then
    missing=""
    for name in $required; do
      grep -Eq "^${name}(_bucket|_count|_sum|_created)?[{ ]" "$scrape" || missing="$missing $name"
    done
    [ -z "$missing" ] && break
    why="$base/metrics lacks$missing (is mono decode installed and the plugin loaded?)"
  else
    why="$base/health or $base/metrics does not answer"
  fi
  [ "$(date +%s)" -ge "$deadline" ] && fail "$why; gave up after ${timeout}s"
  sleep 3
done
mono_before=$(counter monodecode_steps_total 'path="mono"')
fallback_before=$(counter monodecode_fallback_steps_total '')

# 2. one completion (JSON-escape the model name: backslashes and quotes)
model_json=$(printf '%s' "$model" | sed 's/\\/\\\\/g; s/"/\\"/g')
body="{\"model\": \"$model_json\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}"
if [ -n "$API_KEY" ]; then
  timeout 120 wget -q -O /tmp/completion --header "Content-Type: application/json" \
    --header "Authorization: Bearer $API_KEY" --post-data "$body" "$base/v1/completions"
else
  timeout 120 wget -q -O /tmp/completion --header "Content-Type: application/json" \
    --post-data "$body" "$base/v1/completions"
fi || fail "POST $base/v1/completions for model $model failed (wrong model name, or an API key is required: apiKey.existingSecret)"
grep -q '"choices"' /tmp/completion || fail "$base/v1/completions answered without choices: $(head -c 300 /tmp/completion)"

# 3. the steps it took, mono or fallback (a few scrapes, until the worker's counts show)
tries=0
while :; do
  fetch_metrics || fail "$base/metrics stopped answering after the completion"
  mono_after=$(counter monodecode_steps_total 'path="mono"')
  fallback_after=$(counter monodecode_fallback_steps_total '')
  [ $((mono_after + fallback_after)) -gt $((mono_before + fallback_before)) ] && break
  tries=$((tries + 1))
  [ "$tries" -ge 10 ] && fail "the completion answered but no decode step was counted (mono or fallback) within 10 s"
  sleep 1
done
enabled=$(awk '/^monodecode_enabled[{ ]/ { v = $NF } END { print v + 0 }' "$scrape")
refusals=$(awk -F'reason="' '/^monodecode_refusal_info\{/ && $NF ~ / 1(\.0)?$/ { split($2, r, "\""); printf "%s%s", sep, r[1]; sep = "," }' "$scrape")
fallbacks=$(awk -F'reason="' '/^monodecode_fallback_steps_total\{/ && $NF !~ / 0(\.0)?$/ { split($2, r, "\""); n = split($0, f, " "); printf "%s%s=%s", sep, r[1], f[n]; sep = " " }' "$scrape")
steps=$((mono_after - mono_before))
if [ "$steps" -gt 0 ]; then
  [ "$expect" = disabled ] && fail "mono decode ran $steps decode steps but monodecode.enabled is false"
  echo "PASS: $base/v1/completions answered; mono decode ran $steps decode steps for it (monodecode_enabled $enabled)"
  exit 0
fi
case "$expect" in
  disabled)
    [ "$enabled" = 0 ] || fail "monodecode.enabled is false but the pod exports monodecode_enabled $enabled"
    echo "PASS: $base/v1/completions answered on stock decode, as configured (monodecode.enabled false)"
    ;;
  mono-or-refused)
    [ -n "$refusals" ] || fail "no decode step ran mono decode and no refusal reason is exported (fallback steps: $fallbacks)"
    echo "PASS: $base/v1/completions answered on stock decode: mono decode refused at start-up ($refusals), which monodecode.on_refusal degrade allows"
    ;;
  *)
    fail "$base/v1/completions answered but no decode step ran mono decode (monodecode_enabled $enabled; refusal: ${refusals:-none}; fallback steps: $fallbacks)"
    ;;
esac
