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
app.kubernetes.io/name: {{ include "vllm-monodecode.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{/* The release's helm test pods (allowed through the NetworkPolicy). */}}
{{- define "vllm-monodecode.testPodSelector" -}}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/component: test
{{- end }}

{{- define "vllm-monodecode.labels" -}}
helm.sh/chart: {{ include "vllm-monodecode.chart" . | quote }}
{{ include "vllm-monodecode.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/part-of: monodecode
monodecode.io/arch: {{ .Values.arch | quote }}
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

{{/* The model `vllm serve` gets as its first argument. */}}
{{- define "vllm-monodecode.modelArg" -}}
{{- if eq .Values.model.source "hf" }}
{{- .Values.model.hf.id }}
{{- else if eq .Values.model.source "pvc" }}
{{- printf "%s/%s" .Values.model.mountPath (.Values.model.pvc.path | trimPrefix "/") | trimSuffix "/" }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* The model_name label of vLLM's metrics: --served-model-name, else the model argument. */}}
{{- define "vllm-monodecode.metricsModelName" -}}
{{- .Values.model.servedName | default (include "vllm-monodecode.modelArg" .) }}
{{- end }}

{{/* What the helm test accepts (files/helm-test.sh): mono steps, or stock decode with a refusal
reason (on_refusal degrade), or stock decode (mono decode off). */}}
{{- define "vllm-monodecode.helmTestExpect" -}}
{{- if not .Values.monodecode.enabled }}disabled
{{- else if eq .Values.monodecode.on_refusal "degrade" }}mono-or-refused
{{- else }}mono
{{- end }}
{{- end }}

{{/* PromQL label matchers for this release's vLLM series: its namespace and model_name (PromQL
strings take Go's escapes, which %q writes). */}}
{{- define "vllm-monodecode.promSelector" -}}
{{- printf "namespace=%q,model_name=%q" .Release.Namespace (include "vllm-monodecode.metricsModelName" .) }}
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
        - key: {{ .Values.nodeSelection.deviceIdLabel | quote }}
          operator: In
          values:
            {{- toYaml $ids | nindent 12 }}
        {{- with .Values.nodeSelection.partition }}
        {{- if .values }}
        - key: {{ .label | quote }}
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
{{- include "vllm-monodecode.validateExtraArgs" . }}
{{- include "vllm-monodecode.validateImageRepository" . }}
{{- /* a label the chart sets, set again, is a duplicate key in the pod template: the install fails */}}
{{- $chartLabels := include "vllm-monodecode.labels" . | fromYaml }}
{{- $selector := include "vllm-monodecode.selectorLabels" . | fromYaml }}
{{- range $key, $_ := merge (deepCopy (.Values.podLabels | default dict)) (.Values.router.podLabels | default dict) }}
{{- if hasKey ($.Values.podLabels | default dict) $key | and (hasKey ($.Values.router.podLabels | default dict) $key) }}
{{- fail (printf "podLabels and router.podLabels both set %s: set it in one of them" $key) }}
{{- end }}
{{- if hasKey $chartLabels $key }}
{{- $why := " (a second value for one key fails the install)" }}
{{- if hasKey $selector $key }}
{{- $why = " and selects its pods by it (Deployment, Service, PodDisruptionBudget)" }}
{{- else if eq $key "app.kubernetes.io/part-of" }}
{{- $why = ", and MonodecodeMetricsAbsent finds the pods by it" }}
{{- end }}
{{- fail (printf "%s must not set %s: the chart sets it to %s%s" (ternary "podLabels" "router.podLabels" (hasKey ($.Values.podLabels | default dict) $key)) $key (get $chartLabels $key) $why) }}
{{- end }}
{{- end }}
{{- /* Kubernetes refuses a request above its limit only when the Deployment is applied */}}
{{- $requests := .Values.resources.requests | default dict }}
{{- $limits := .Values.resources.limits | default dict }}
{{- range $name, $request := $requests }}
{{- $limit := get $limits $name }}
{{- if and (hasKey $limits $name) (gt (include "vllm-monodecode.quantity" $request | float64) (include "vllm-monodecode.quantity" $limit | float64)) }}
{{- fail (printf "resources.requests.%s (%v) is more than resources.limits.%s (%v): Kubernetes refuses the pod; lower the request or raise the limit" $name $request $name $limit) }}
{{- end }}
{{- end }}
{{- $cache := .Values.model.hf.cache }}
{{- $pods := include "vllm-monodecode.maxPods" . | fromJson }}
{{- if and (eq $src "hf") (eq $cache.type "create") (gt (int $pods.count) 1) (not (has "ReadWriteMany" $cache.accessModes)) }}
{{- fail (printf "%s with one created model cache claim that is %s: pods on other nodes cannot mount it; set model.hf.cache.accessModes to [ReadWriteMany] (a shared cache), or run one pod" $pods.why (join ", " $cache.accessModes)) }}
{{- end }}
{{- with .Values.autoscaling }}
{{- if .enabled }}
{{- if lt (int .maxReplicas) (int .minReplicas) }}
{{- fail (printf "autoscaling.maxReplicas (%d) is below autoscaling.minReplicas (%d)" (int .maxReplicas) (int .minReplicas)) }}
{{- end }}
{{- if and (eq .kind "keda") (not .keda.serverAddress) }}
{{- fail "autoscaling.keda.serverAddress is empty: give the URL of the Prometheus that scrapes the pods (autoscaling.kind is keda), e.g. http://prometheus-operated.monitoring.svc:9090" }}
{{- end }}
{{- if and (eq .kind "hpa") .latency.enabled }}
{{- fail "autoscaling.latency.enabled needs autoscaling.kind keda: the hpa kind scales on the per-pod queue the Prometheus adapter serves" }}
{{- end }}
{{- end }}
{{- end }}
{{- /* extra volumes, mounts and containers must not take the chart's names or paths */}}
{{- $volumes := list "model" "shm" "tmp" "cache" "failstop" }}
{{- range .Values.extraVolumes }}
{{- if has .name $volumes }}
{{- fail (printf "extraVolumes has a volume named %s, a name the chart uses (%s): rename it" .name (join ", " $volumes)) }}
{{- end }}
{{- end }}
{{- $mounts := list .Values.model.mountPath "/dev/shm" "/tmp" "/cache" "/var/lib/monodecode/failstop" }}
{{- range .Values.extraVolumeMounts }}
{{- if has (.mountPath | trimSuffix "/") $mounts }}
{{- fail (printf "extraVolumeMounts mounts %s at %s, where the chart mounts its own volume (%s): choose another path" .name .mountPath (join ", " $mounts)) }}
{{- end }}
{{- end }}
{{- range .Values.extraContainers }}
{{- if has .name (list "vllm" "gpu-access") }}
{{- fail (printf "extraContainers has a container named %s, a name the chart uses: rename it" .name) }}
{{- end }}
{{- end }}
{{- /* the disk emptyDirs count against ephemeral-storage: a lower limit evicts the pod first */}}
{{- with get (.Values.resources.limits | default dict) "ephemeral-storage" }}
{{- $scratch := $.Values.scratch }}
{{- $sum := 0.0 }}
{{- $parts := list }}
{{- range $name, $size := dict "tmp" $scratch.tmpSizeLimit "cache" $scratch.cacheSizeLimit "failstop" $scratch.failstopSizeLimit }}
{{- $sum = addf $sum (include "vllm-monodecode.quantity" $size | float64) }}
{{- $parts = append $parts (printf "%s %v" $name $size) }}
{{- end }}
{{- if and (eq $.Values.model.source "hf") (eq $.Values.model.hf.cache.type "emptyDir") }}
{{- $sum = addf $sum (include "vllm-monodecode.quantity" $.Values.model.hf.cache.size | float64) }}
{{- $parts = append $parts (printf "model %v" $.Values.model.hf.cache.size) }}
{{- end }}
{{- if lt (include "vllm-monodecode.quantity" . | float64) $sum }}
{{- fail (printf "resources.limits.ephemeral-storage (%v) is below the size limits of the pod's disk emptyDirs (%s): the kubelet would evict the pod before they fill; raise it or lower scratch.* / model.hf.cache.size" . (join " + " $parts)) }}
{{- end }}
{{- end }}
{{- /* variables the chart sets from a value: set twice, the container's env would hold both */}}
{{- $owned := dict "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" "vllm.keepAliveSeconds" }}
{{- if .Values.apiKey.existingSecret }}
{{- $_ := set $owned "VLLM_API_KEY" "apiKey.existingSecret" }}
{{- end }}
{{- range .Values.env }}
{{- if hasKey $owned .name }}
{{- fail (printf "env sets %s, which the chart sets from %s: remove it from env" .name (get $owned .name)) }}
{{- end }}
{{- end }}
{{- with .Values.networkPolicy }}
{{- if and .enabled (not (or .apiFrom .apiNamespaces)) }}
{{- fail "networkPolicy.enabled with empty networkPolicy.apiFrom and apiNamespaces: nothing could call the API; name the callers (e.g. the gateway's or router's pods)" }}
{{- end }}
{{- end }}
{{- if and .Values.router.inferencePool.enabled (not .Values.router.inferencePool.endpointPicker.name) }}
{{- fail "router.inferencePool.endpointPicker.name is empty: name the Service of llm-d's inference scheduler (the endpoint picker) the pool sends its requests through" }}
{{- end }}
{{- if and .Values.ingress.enabled (not .Values.ingress.hosts) }}
{{- fail "ingress.enabled with empty ingress.hosts: give at least one {host, paths}" }}
{{- end }}
{{- if and .Values.httpRoute.enabled (not .Values.httpRoute.parentRefs) }}
{{- fail "httpRoute.enabled with empty httpRoute.parentRefs: name the Gateway to attach to, e.g. [{name: inference-gateway, namespace: gateway}]" }}
{{- end }}
{{- if and (eq .Values.rollout.strategy "Recreate") (gt (int .Values.rollout.maxSurge) 0) }}
{{- fail "rollout.maxSurge is set but rollout.strategy is Recreate, which ignores it: set rollout.strategy=RollingUpdate, or rollout.maxSurge=0" }}
{{- end }}
{{- $stop := add .Values.lifecycle.preStopSleepSeconds .Values.lifecycle.drainSeconds 5 }}
{{- if gt (int $stop) (int .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) is shorter than lifecycle.preStopSleepSeconds (%d) + lifecycle.drainSeconds (%d) + 5 s for vLLM to stop: the pod would be killed mid-drain; raise it to %d or shorten the drain" (int .Values.terminationGracePeriodSeconds) (int .Values.lifecycle.preStopSleepSeconds) (int .Values.lifecycle.drainSeconds) (int $stop)) }}
{{- end }}
{{- if .Values.monitoring.scrapeAnnotations }}
{{- range $monitor := list "podMonitor" "serviceMonitor" }}
{{- if (get $.Values.monitoring $monitor).enabled }}
{{- fail (printf "monitoring.%s.enabled and monitoring.scrapeAnnotations are both true: every series would be scraped twice; enable one" $monitor) }}
{{- end }}
{{- end }}
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

{{/* Most pods the Deployment can have at once, and where that number comes from (checks that
depend on pods sharing a volume). */}}
{{- define "vllm-monodecode.maxPods" -}}
{{- $n := int .Values.replicaCount }}
{{- $why := printf "replicaCount %d" $n }}
{{- if .Values.autoscaling.enabled }}
{{- $n = int .Values.autoscaling.maxReplicas }}
{{- $why = printf "autoscaling.maxReplicas %d" $n }}
{{- end }}
{{- if and (eq .Values.rollout.strategy "RollingUpdate") (gt (int .Values.rollout.maxSurge) 0) }}
{{- $n = add $n .Values.rollout.maxSurge }}
{{- $why = printf "%s + rollout.maxSurge %d" $why (int .Values.rollout.maxSurge) }}
{{- end }}
{{- dict "count" $n "why" $why | toJson }}
{{- end }}

{{/* A Kubernetes quantity (8, "500m", "1.5G", "64Gi") as a plain number, for comparing two. */}}
{{- define "vllm-monodecode.quantity" -}}
{{- $q := toString . }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $suffix := trimPrefix $number $q }}
{{- $scale := dict "" 1 "m" 0.001 "k" 1000 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 }}
{{- if not (and $number (hasKey $scale $suffix)) }}
{{- fail (printf "%q is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)" $q) }}
{{- end }}
{{- mulf (float64 $number) (get $scale $suffix) }}
{{- end }}

{{/*
`vllm serve` flags the chart sets itself (or that change the GPUs a pod needs), each with what to
set instead. vLLM reads --a_b as --a-b, and argparse takes an unambiguous prefix of a flag.
*/}}
{{- define "vllm-monodecode.validateExtraArgs" -}}
{{- $tp := ", which the chart sets: use vllm.tensorParallelSize (the pod's GPU request follows it)" }}
{{- $gpus := ": each pod gets vllm.tensorParallelSize GPUs for one engine; use replicaCount for more copies" }}
{{- $model := ", which the chart sets: use model.source with model.hf.id, model.pvc or model.hostPath (the chart passes the model as serve's first argument)" }}
{{- $owned := dict
  "--host" ", which the chart sets: it binds 0.0.0.0, where the probes and the Service reach the server"
  "--port" ", which the chart sets: use vllm.port"
  "--tensor-parallel-size" $tp "-tp" $tp
  "--pipeline-parallel-size" $gpus "-pp" $gpus
  "--data-parallel-size" $gpus "-dp" $gpus
  "--gpu-memory-utilization" ", which the chart sets: use vllm.gpuMemoryUtilization"
  "--dtype" ", which the chart sets: use vllm.dtype"
  "--block-size" ", which the chart sets: use vllm.blockSize (mono decode kernels are built for it)"
  "--max-model-len" ", which the chart sets: use vllm.maxModelLen"
  "--max-num-seqs" ", which the chart sets: use vllm.maxNumSeqs"
  "--served-model-name" ", which the chart sets: use model.servedName"
  "--additional-config" ", which the chart sets: use the monodecode values block (the chart passes it as --additional-config)"
  "--revision" ", which the chart sets: use model.hf.revision"
  "--shutdown-timeout" ", which the chart sets: use lifecycle.drainSeconds"
  "--api-key" ", which the chart sets from apiKey.existingSecret (a key on the command line shows in the pod spec)"
  "--model" $model
}}
{{- if .Values.monodecode.enabled }}
{{- $serve := include "vllm-monodecode.serveSettings" . | fromJson }}
{{- $_ := set $owned (first $serve.args) (printf ", which the chart sets to %s for mono decode (vllm.attentionBackend): set vllm.attentionBackend instead, or set monodecode.enabled=false" (index $serve.args 1)) }}
{{- end }}
{{- range .Values.vllm.extraArgs }}
{{- $flag := first (splitList "=" .) }}
{{- if hasPrefix "--" $flag }}
{{- $flag = printf "--%s" ($flag | trimPrefix "--" | replace "_" "-") }}
{{- end }}
{{- if hasKey $owned $flag }}
{{- fail (printf "vllm.extraArgs sets %s%s" $flag (get $owned $flag)) }}
{{- end }}
{{- if and (hasPrefix "--" $flag) (gt (len $flag) 3) }}
{{- range $long, $why := $owned }}
{{- if and (hasPrefix $flag $long) (ne $flag $long) }}
{{- fail (printf "vllm.extraArgs sets %s (argparse reads it as %s)%s" $flag $long $why) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
image.repository against the OCI distribution reference grammar (github.com/distribution/reference):
[host[:port]/]path, path components lowercase alphanumerics joined by ".", "_", "__" or dashes.
The first component is the registry host when it has a "." or ":", is "localhost" or has capitals
(how Docker splits a name). Tag and digest have their own values.
*/}}
{{- define "vllm-monodecode.validateImageRepository" -}}
{{- $repo := .Values.image.repository }}
{{- $what := printf "image.repository %q" $repo }}
{{- if gt (len $repo) 255 }}
{{- fail (printf "%s is longer than 255 characters, the limit of an image name" $what) }}
{{- end }}
{{- if contains "@" $repo }}
{{- fail (printf "%s carries a digest: set it with image.digests.%s, and the repository without it" $what .Values.arch) }}
{{- end }}
{{- $parts := splitList "/" $repo }}
{{- $lastPart := last $parts }}
{{- if and (contains ":" $lastPart) (not (hasPrefix "[" $lastPart)) }}
{{- fail (printf "%s ends in the tag \":%s\": set the tag with image.tags.%s, and the repository without it" $what (last (splitList ":" $lastPart)) .Values.arch) }}
{{- end }}
{{- $first := first $parts }}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost") (ne $first (lower $first))) }}
{{- if not (regexMatch "^(\\[[0-9a-fA-F:.]+\\]|[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?(\\.[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*)(:[0-9]+)?$" $first) }}
{{- fail (printf "%s: registry host %q is not valid: a DNS name (letters, digits, '-', dot-separated) or [IPv6], with an optional :port" $what $first) }}
{{- end }}
{{- $parts = rest $parts }}
{{- end }}
{{- range $parts }}
{{- if not . }}
{{- fail (printf "%s has an empty path component (a leading, trailing or doubled /)" $what) }}
{{- end }}
{{- if not (regexMatch "^[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*$" .) }}
{{- fail (printf "%s: path component %q is not valid: lowercase letters and digits, joined by one '.', one or two '_', or dashes" $what .) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fails when a Prometheus-operator kind is asked for but the cluster does not serve it. */}}
{{- define "vllm-monodecode.requireMonitoringKind" -}}
{{- include "vllm-monodecode.requireKind" (list (index . 0) "monitoring.coreos.com/v1" (index . 1) (index . 2) "the Prometheus Operator CRDs") }}
{{- end }}

{{/* Fails when a kind is asked for (flag) but the cluster does not serve its API:
(list $ apiVersion kind flag what-to-install). */}}
{{- define "vllm-monodecode.requireKind" -}}
{{- $ctx := index . 0 }}
{{- $api := index . 1 }}
{{- $kind := index . 2 }}
{{- if not ($ctx.Capabilities.APIVersions.Has (printf "%s/%s" $api $kind)) }}
{{- fail (printf "%s is true but the cluster has no %s %s (install %s, or with `helm template` pass --api-versions %s/%s)" (index . 3) $api $kind (index . 4) $api $kind) }}
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
{{- if not $cfg.runbookBaseUrl }}
{{- fail "prometheusRule.runbookBaseUrl is empty: set the absolute URL where deploy/RUNBOOK.md is served (e.g. https://git.example.com/ml/monodecode/blob/main/deploy/RUNBOOK.md); every alert's runbook_url becomes that URL#<alert name>" }}
{{- end }}
{{- $known := list }}
{{- $groups := list }}
{{- range $g := $doc.groups }}
{{- $rules := list }}
{{- range $r := $g.rules }}
{{- if $r.record }}
{{- /* recording rules: as written (the alerts and the dashboard read them) */}}
{{- $rules = append $rules $r }}
{{- else }}
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
{{- $ann := deepCopy $r.annotations }}
{{- $_ := set $ann "runbook_url" (regexReplaceAll "^deploy/RUNBOOK\\.md" $ann.runbook_url $cfg.runbookBaseUrl) }}
{{- $_ := set $rule "annotations" $ann }}
{{- $rules = append $rules $rule }}
{{- end }}
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

{{/* autoscaling/v2 behavior from autoscaling.scaleUp / scaleDown (the HPA's, and KEDA's HPA's). */}}
{{- define "vllm-monodecode.scalingBehavior" -}}
{{- range $direction := list "scaleUp" "scaleDown" }}
{{- with get $ $direction }}
{{ $direction }}:
  stabilizationWindowSeconds: {{ .stabilizationWindowSeconds }}
  selectPolicy: Max
  policies:
    - type: Pods
      value: {{ .pods }}
      periodSeconds: {{ .periodSeconds }}
{{- end }}
{{- end }}
{{- end }}

{{/* A monitor's metricRelabelings: vLLM's `vllm:` names restored first (see
monitoring.restoreVllmMetricNames), then the user's. (list $ userRelabelings) */}}
{{- define "vllm-monodecode.metricRelabelings" -}}
{{- $ctx := index . 0 }}
{{- $rules := list }}
{{- if $ctx.Values.monitoring.restoreVllmMetricNames }}
{{- $rules = append $rules (dict "sourceLabels" (list "__name__") "regex" "vllm_(.+)" "targetLabel" "__name__" "replacement" "vllm:${1}" "action" "replace") }}
{{- end }}
{{- toYaml (concat $rules (index . 1 | default list)) }}
{{- end }}
