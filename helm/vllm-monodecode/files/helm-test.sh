# `helm test`: scrape the release's /metrics until every series `monodecode-ops verify --endpoint`
# requires is there, or fail after the timeout. Plain sh + wget, so a busybox image runs it.
# Usage: sh -c "$(cat helm-test.sh)" helm-test URL TIMEOUT_SECONDS
url="$1"
timeout="$2"
required="monodecode_enabled monodecode_steps_total monodecode_fallback_steps_total monodecode_step_duration_seconds monodecode_failstop_total"
scrape=/tmp/metrics
deadline=$(( $(date +%s) + timeout ))
while :; do
  if wget -q -T 10 -O "$scrape" "$url"; then
    missing=""
    for name in $required; do
      grep -Eq "^${name}(_bucket|_count|_sum|_created)?[{ ]" "$scrape" || missing="$missing $name"
    done
    if [ -z "$missing" ]; then
      echo "PASS: $url carries every monodecode series:"
      grep -E '^monodecode_(enabled|steps_total)[{ ]' "$scrape"
      exit 0
    fi
    why="lacks$missing (is mono decode installed and the plugin loaded?)"
  else
    why="cannot be scraped"
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "FAIL: $url $why; gave up after ${timeout}s" >&2
    exit 1
  fi
  sleep 3
done
