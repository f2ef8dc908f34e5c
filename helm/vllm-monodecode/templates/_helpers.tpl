{{/* Names and labels (prometheus-community style). */}}

{{- define "vllm-monodecode.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* release-chart, or the release name alone when it already contains the chart name. */}}
{{- define "vllm-monodecode.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "vllm-monodecode.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vllm-monodecode.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-monodecode.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vllm-monodecode.labels" -}}
helm.sh/chart: {{ include "vllm-monodecode.chart" . }}
{{ include "vllm-monodecode.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: monodecode
monodecode.io/arch: {{ .Values.arch }}
{{- end }}

{{- define "vllm-monodecode.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vllm-monodecode.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image for .Values.arch: repository@digest when a digest is set, else repository:tag. */}}
{{- define "vllm-monodecode.image" -}}
{{- $arch := .Values.arch }}
{{- $digest := get .Values.image.digests $arch }}
{{- $tag := get .Values.image.tags $arch | default (printf "%s-%s" .Chart.AppVersion $arch) }}
{{- if $digest }}
{{- printf "%s@%s" .Values.image.repository $digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* Required node affinity term: GPUs of the chosen arch, by PCI device id. */}}
{{- define "vllm-monodecode.nodeAffinity" -}}
{{- $ids := get .Values.nodeSelection.deviceIds .Values.arch }}
{{- if not $ids }}
{{- fail (printf "nodeSelection.deviceIds.%s is empty: list the PCI device ids of %s GPUs, or set nodeSelection.enabled=false" .Values.arch .Values.arch) }}
{{- end }}
requiredDuringSchedulingIgnoredDuringExecution:
  nodeSelectorTerms:
    - matchExpressions:
        - key: {{ .Values.nodeSelection.deviceIdLabel }}
          operator: In
          values:
            {{- toYaml $ids | nindent 12 }}
        {{- with .Values.nodeSelection.partition }}
        {{- if .values }}
        - key: {{ .label }}
          operator: In
          values:
            {{- toYaml .values | nindent 12 }}
        {{- end }}
        {{- end }}
        {{- with .Values.nodeSelection.extraRequirements }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- with .Values.affinity.nodeAffinity }}
{{- with .preferredDuringSchedulingIgnoredDuringExecution }}
preferredDuringSchedulingIgnoredDuringExecution:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
vLLM's --additional-config: the monodecode values block as is (its keys are MonoConfig's, checked
by the generated values.schema.json), null values left out, failstop_dir set to the chart's volume.
*/}}
{{- define "vllm-monodecode.monoConfig" -}}
{{- $c := dict }}
{{- range $key, $value := .Values.monodecode }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $c $key $value }}
{{- end }}
{{- end }}
{{- $_ := set $c "failstop_dir" "/var/lib/monodecode/failstop" }}
{{- dict "monodecode" $c | toJson }}
{{- end }}

{{/* The attention backend + KV layout pair mono decode runs with on ROCm, vllm.attentionBackend's
(files/serve-settings.json, generated from monodecode.vllm_plugin.serving by deploy/sync_chart.py). */}}
{{- define "vllm-monodecode.serveSettings" -}}
{{- $doc := .Files.Get "files/serve-settings.json" | fromJson }}
{{- if or (hasKey $doc "Error") (not $doc.pairs) }}
{{- fail "files/serve-settings.json is missing or invalid in the chart (generate it: python deploy/sync_chart.py)" }}
{{- end }}
{{- $pair := get $doc.pairs (.Values.vllm.attentionBackend | default $doc.default) }}
{{- if not $pair }}
{{- fail (printf "vllm.attentionBackend %v: mono decode on ROCm runs with %s" .Values.vllm.attentionBackend (keys $doc.pairs | sortAlpha | join ", ")) }}
{{- end }}
{{- toJson $pair }}
{{- end }}

{{/* Seconds the startup probe allows: weight load + warm-up, rounded up to whole periods. */}}
{{- define "vllm-monodecode.startupFailureThreshold" -}}
{{- $p := .Values.probes.startup }}
{{- $total := add $p.weightLoadSeconds $p.warmupSeconds }}
{{- div (add $total $p.periodSeconds -1) $p.periodSeconds }}
{{- end }}

{{/* Checks across values that the JSON schema cannot express; each fails with one line. */}}
{{- define "vllm-monodecode.validate" -}}
{{- $gpu := .Values.gpuResourceName }}
{{- range $kind := list "requests" "limits" }}
{{- if hasKey (get $.Values.resources $kind | default dict) $gpu }}
{{- fail (printf "resources.%s must not set %s: the GPU count comes from vllm.tensorParallelSize" $kind $gpu) }}
{{- end }}
{{- end }}
{{- $src := .Values.model.source }}
{{- if and (eq $src "hf") (not .Values.model.hf.id) }}
{{- fail "model.hf.id is empty: name the Hugging Face model (model.source is hf)" }}
{{- end }}
{{- if and (eq $src "hf") (eq .Values.model.hf.cache.type "pvc") (not .Values.model.hf.cache.claimName) }}
{{- fail "model.hf.cache.claimName is empty: name the existing claim (model.hf.cache.type is pvc)" }}
{{- end }}
{{- if and (eq $src "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.pvc.claimName is empty: name the claim holding the model (model.source is pvc)" }}
{{- end }}
{{- if and (eq $src "hostPath") (not .Values.model.hostPath.path) }}
{{- fail "model.hostPath.path is empty: give the model directory on the node (model.source is hostPath)" }}
{{- end }}
{{- if and .Values.nodeSelection.enabled .Values.affinity.nodeAffinity }}
{{- if .Values.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution }}
{{- fail "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution conflicts with nodeSelection, which renders the required arch term: add requirements to nodeSelection.extraRequirements, or set nodeSelection.enabled=false" }}
{{- end }}
{{- end }}
{{- $m := .Values.monodecode }}
{{- if $m.enabled }}
{{- if and (gt (int .Values.vllm.tensorParallelSize) 1) (eq ($m.on_refusal | default "raise") "raise") }}
{{- fail (printf "vllm.tensorParallelSize %d with monodecode.on_refusal raise always crash-loops: mono decode refuses tensor parallelism (tp_shards) until it lands; set monodecode.on_refusal=degrade (stock decode, reasons exported) or monodecode.enabled=false" (int .Values.vllm.tensorParallelSize)) }}
{{- end }}
{{- $serve := include "vllm-monodecode.serveSettings" . | fromJson }}
{{- $flag := first $serve.args }}
{{- range .Values.vllm.extraArgs }}
{{- if or (eq . $flag) (hasPrefix (printf "%s=" $flag) .) }}
{{- fail (printf "vllm.extraArgs sets %s, which the chart sets to %s for mono decode (vllm.attentionBackend): set vllm.attentionBackend instead, or set monodecode.enabled=false" $flag (index $serve.args 1)) }}
{{- end }}
{{- end }}
{{- range .Values.env }}
{{- if hasKey $serve.env .name }}
{{- fail (printf "env sets %s, which the chart sets to %s for mono decode: remove it, or set monodecode.enabled=false" .name (get $serve.env .name)) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* the one MonoConfig rule JSON schema cannot say (null widths: the schema requires the key) */}}
{{- $prev := 0 }}
{{- range $m.widths }}
{{- if le (int .) $prev }}
{{- fail (printf "monodecode.widths must be ascending, got %s" (toJson $m.widths)) }}
{{- end }}
{{- $prev = int . }}
{{- end }}
{{- if hasKey (.Values.podLabels | default dict) "app.kubernetes.io/part-of" }}
{{- fail "podLabels must not set app.kubernetes.io/part-of: the chart sets it to monodecode, and MonodecodeMetricsAbsent finds the pods by it" }}
{{- end }}
{{- if and (ne $src "pvc") .Values.model.pvc.claimName }}
{{- fail (printf "model.pvc.claimName is set but model.source is %s, which ignores it: set model.source=pvc%s" $src (ternary ", or use model.hf.cache.claimName for a download cache" "" (eq $src "hf"))) }}
{{- end }}
{{- if and (ne $src "hostPath") .Values.model.hostPath.path }}
{{- fail (printf "model.hostPath.path is set but model.source is %s, which ignores it: set model.source=hostPath, or clear model.hostPath.path" $src) }}
{{- end }}
{{- if hasKey (.Values.prometheusRule.additionalRuleLabels | default dict) "severity" }}
{{- fail "prometheusRule.additionalRuleLabels.severity is set, but every alert keeps its own severity: change one alert's with prometheusRule.alerts.<AlertName>.severity" }}
{{- end }}
{{- if and .Values.monitoring.serviceMonitor.enabled .Values.monitoring.podMonitor.enabled }}
{{- fail "monitoring.serviceMonitor.enabled and monitoring.podMonitor.enabled are both true: enable one, or every series is scraped twice" }}
{{- end }}
{{- $budget := add .Values.probes.startup.weightLoadSeconds .Values.probes.startup.warmupSeconds }}
{{- if lt (int .Values.rollout.progressDeadlineSeconds) (int $budget) }}
{{- fail (printf "rollout.progressDeadlineSeconds (%d) is shorter than the startup budget probes.startup.weightLoadSeconds + warmupSeconds (%d): rollouts would be reported failed while pods are still warming up" (int .Values.rollout.progressDeadlineSeconds) (int $budget)) }}
{{- end }}
{{- end }}

{{/* Fails when a Prometheus-operator kind is asked for but the cluster does not serve it. */}}
{{- define "vllm-monodecode.requireMonitoringKind" -}}
{{- $kind := index . 1 }}
{{- $ctx := index . 0 }}
{{- $flag := index . 2 }}
{{- if not ($ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $kind)) }}
{{- fail (printf "%s is true but the cluster has no monitoring.coreos.com/v1 %s (install the Prometheus Operator CRDs, or with `helm template` pass --api-versions monitoring.coreos.com/v1/%s)" $flag $kind $kind) }}
{{- end }}
{{- end }}

{{/*
The alert rule groups of files/monodecode-alerts.yaml (a link to deploy/prometheus/, the one
source of truth) with the chart's per-alert overrides applied: disabled, for, severity, extra
labels and the runbook base URL. Expressions are never changed.
*/}}
{{- define "vllm-monodecode.ruleGroups" -}}
{{- $src := .Files.Get "files/monodecode-alerts.yaml" }}
{{- if not $src }}
{{- fail "files/monodecode-alerts.yaml is missing or empty in the chart (it links to deploy/prometheus/monodecode-alerts.yaml)" }}
{{- end }}
{{- $doc := fromYaml $src }}
{{- if hasKey $doc "Error" }}
{{- fail (printf "files/monodecode-alerts.yaml is not valid YAML: %s" (get $doc "Error")) }}
{{- end }}
{{- $cfg := .Values.prometheusRule }}
{{- $known := list }}
{{- $groups := list }}
{{- range $g := $doc.groups }}
{{- $rules := list }}
{{- range $r := $g.rules }}
{{- $known = append $known $r.alert }}
{{- $o := get $cfg.alerts $r.alert | default dict }}
{{- if not $o.disabled }}
{{- $rule := deepCopy $r }}
{{- with $o.for }}
{{- $_ := set $rule "for" . }}
{{- end }}
{{- $labels := mergeOverwrite (deepCopy ($cfg.additionalRuleLabels | default dict)) (deepCopy ($r.labels | default dict)) }}
{{- with $o.severity }}
{{- $_ := set $labels "severity" . }}
{{- end }}
{{- $_ := set $rule "labels" $labels }}
{{- with $cfg.runbookBaseUrl }}
{{- $ann := deepCopy $r.annotations }}
{{- $_ := set $ann "runbook_url" (regexReplaceAll "^deploy/RUNBOOK\\.md" $ann.runbook_url .) }}
{{- $_ := set $rule "annotations" $ann }}
{{- end }}
{{- $rules = append $rules $rule }}
{{- end }}
{{- end }}
{{- if $rules }}
{{- $groups = append $groups (dict "name" $g.name "rules" $rules) }}
{{- end }}
{{- end }}
{{- range $name, $_ := $cfg.alerts }}
{{- if not (has $name $known) }}
{{- fail (printf "prometheusRule.alerts.%s: no such alert (alerts: %s)" $name (join ", " $known)) }}
{{- end }}
{{- end }}
{{- toYaml $groups }}
{{- end }}
