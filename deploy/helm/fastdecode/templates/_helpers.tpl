{{/* Chart name. */}}
{{- define "fastdecode.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name; component suffixes are kept short so names stay under 63. */}}
{{- define "fastdecode.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fastdecode.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels; call with (dict "root" $ "component" "gateway"). */}}
{{- define "fastdecode.labels" -}}
helm.sh/chart: {{ include "fastdecode.chart" .root }}
{{ include "fastdecode.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: fastdecode
{{- end }}

{{- define "fastdecode.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fastdecode.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- if and (include "fastdecode.replicated" .root) (not (kindIs "invalid" .fleet)) }}
{{- /* several fleets in one release: each fleet's Services and selectors see its own pods only */}}
fastdecode.io/fleet: {{ .fleet | quote }}
{{- end }}
{{- end }}

{{/* Non-empty when the release runs several whole fleets (replicas.count > 1). */}}
{{- define "fastdecode.replicated" -}}
{{- if gt (int .Values.replicas.count) 1 }}true{{ end }}
{{- end }}

{{/* Name prefix of one fleet's objects; call with (dict "root" $ "fleet" i). One fleet (the default):
     the fullname, as ever. Several: <fullname>-r<i> (the fullname cut to 35 characters so the
     shards' StatefulSet name stays short enough for its pods' controller-revision-hash label). */}}
{{- define "fastdecode.fleetname" -}}
{{- $full := include "fastdecode.fullname" .root }}
{{- if include "fastdecode.replicated" .root }}
{{- printf "%s-r%d" ($full | trunc 35 | trimSuffix "-") (int .fleet) }}
{{- else }}
{{- $full }}
{{- end }}
{{- end }}

{{/* Fleet i's gateway HTTP URL, the router's worker URL; call with (dict "root" $ "fleet" i). */}}
{{- define "fastdecode.gatewayURL" -}}
{{- printf "http://%s-gateway.%s.svc.%s:%d" (include "fastdecode.fleetname" .) .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.gateway.http.port) }}
{{- end }}

{{/* The image; call with (dict "root" $ "gpu" true) for gpu_dense's. */}}
{{- define "fastdecode.image" -}}
{{- $repo := .root.Values.image.repository }}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag }}
{{- if and .gpu .root.Values.gpu.enabled }}
{{- $repo = default $repo .root.Values.gpu.image.repository }}
{{- $tag = default $tag .root.Values.gpu.image.tag }}
{{- end }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* The router's image: router.image, else the fleet's repository with tag <tag>-router (the image
     built with --build-arg EXTRAS=server,router, deploy/README.md). */}}
{{- define "fastdecode.routerImage" -}}
{{- $repo := default .Values.image.repository .Values.router.image.repository }}
{{- $tag := default (printf "%s-router" (default .Chart.AppVersion .Values.image.tag)) .Values.router.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* Headless Service (and StatefulSet) of one fleet's shards; call with (dict "root" $ "fleet" i). */}}
{{- define "fastdecode.kvService" -}}
{{- printf "%s-kv-attention" (include "fastdecode.fleetname" .) }}
{{- end }}

{{/* One fleet's stable shard addresses, shard-id order: <sts>-<i>.<headless svc>.<ns>.svc.<domain>:<port>;
     call with (dict "root" $ "fleet" i). */}}
{{- define "fastdecode.shardAddresses" -}}
{{- $root := .root }}
{{- $svc := include "fastdecode.kvService" . }}
{{- $addrs := list }}
{{- range $i := until (int $root.Values.kvAttention.shards) }}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%d" $svc $i $svc $root.Release.Namespace $root.Values.clusterDomain (int $root.Values.kvAttention.port)) }}
{{- end }}
{{- with $root.Values.gpuDense.hostShard }}{{ if .enabled }}
{{- /* the shard gpu_dense hosts, last: reached through gpu_dense's Service */}}
{{- $addrs = append $addrs (printf "%s-gpu-dense.%s.svc.%s:%d" (include "fastdecode.fleetname" $) $root.Release.Namespace $root.Values.clusterDomain (int .port)) }}
{{- end }}{{ end }}
{{- join "," $addrs }}
{{- end }}

{{/* Probes; call with (dict "root" $ "port" 50051). */}}
{{- define "fastdecode.probes" -}}
{{- $root := .root }}
{{- $port := int .port }}
{{- range $kind := list "startup" "liveness" "readiness" }}
{{- $p := index $root.Values.probes $kind }}
{{- /* Readiness: can it do its work now (the fleet behind it included); startup and liveness: does
the process work (health service "liveness"), so a lost peer never gets a healthy pod restarted. */}}
{{- $service := ternary "" "liveness" (eq $kind "readiness") }}
{{ $kind }}Probe:
  {{- if $root.Values.tls.enabled }}
  # kubelet's grpc probe cannot speak TLS: ask the server from inside the pod.
  exec:
    command: ["fastdecode", "health", "--target", "127.0.0.1:{{ $port }}", "--service", "{{ $service }}", "--timeout", "{{ $p.timeoutSeconds }}"]
  {{- else }}
  grpc:
    port: {{ $port }}
    {{- if $service }}
    service: {{ $service }}
    {{- end }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  timeoutSeconds: {{ add $p.timeoutSeconds 2 }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every component; call with the root context, or with
     (dict "root" $ "extraGrace" N) to give a component N more seconds to stop (a shard's drain). */}}
{{- define "fastdecode.podCommon" -}}
{{- $root := .root | default . -}}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ add $root.Values.terminationGracePeriodSeconds (.extraGrace | default 0) }}
enableServiceLinks: false
automountServiceAccountToken: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container settings shared by every component; call with (dict "root" $ "fleet" i "component" "gateway"
     "port" 50051), plus "httpPort" 8000 for a container that also serves HTTP (the gateway). */}}
{{- define "fastdecode.containerCommon" -}}
{{- $root := .root -}}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
securityContext:
  {{- toYaml $root.Values.securityContext | nindent 2 }}
ports:
  - name: grpc
    containerPort: {{ .port }}
    protocol: TCP
  {{- with .httpPort }}
  - name: http
    containerPort: {{ . }}
    protocol: TCP
  {{- end }}
  {{- with .hostShardPort }}
  - name: host-shard
    containerPort: {{ . }}
    protocol: TCP
  {{- end }}
  - name: metrics
    containerPort: {{ $root.Values.metrics.port }}
    protocol: TCP
envFrom:
  - configMapRef:
      name: {{ include "fastdecode.fleetname" . }}-settings
{{- include "fastdecode.probes" (dict "root" $root "port" .port) }}
{{- end }}

{{/* Env every container gets; call with (dict "root" $ "port" 50051). */}}
{{/* The Secret with the fleet secret every internal call carries (docs/internal-auth.md). */}}
{{- define "fastdecode.fleetSecretName" -}}
{{- default (printf "%s-fleet" (include "fastdecode.fullname" .)) .Values.fleetSecret.existingSecret }}
{{- end }}

{{- define "fastdecode.commonEnv" -}}
- name: FASTDECODE_PORT
  value: {{ .port | quote }}
# Internal calls carry it and are checked against it (environment only: argv shows in ps).
- name: FASTDECODE_FLEET_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "fastdecode.fleetSecretName" .root }}
      key: {{ .root.Values.fleetSecret.key }}
{{- if .root.Values.tls.enabled }}
- name: FASTDECODE_TLS_CERT
  value: {{ printf "%s/tls.crt" .root.Values.tls.mountPath | quote }}
- name: FASTDECODE_TLS_KEY
  value: {{ printf "%s/tls.key" .root.Values.tls.mountPath | quote }}
- name: FASTDECODE_TLS_CA
  value: {{ printf "%s/ca.crt" .root.Values.tls.mountPath | quote }}
{{- end }}
{{- end }}

{{/* Volume mounts; call with (dict "root" $ "model" true). */}}
{{- define "fastdecode.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .model }}
- name: model
  mountPath: {{ .root.Values.model.mountPath }}
  readOnly: true
  {{- with .root.Values.model.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: {{ .root.Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "fastdecode.volumes" -}}
- name: tmp
  emptyDir: {}
{{- if .model }}
- name: model
  {{- if eq .root.Values.model.volume.type "hostPath" }}
  hostPath:
    path: {{ .root.Values.model.volume.hostPath.path }}
    type: {{ .root.Values.model.volume.hostPath.type }}
  {{- else }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model" (include "fastdecode.fullname" .root)) .root.Values.model.volume.pvc.existingClaim }}
    readOnly: true
  {{- end }}
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .root.Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* Refuse values that would break a graceful stop. */}}
{{- define "fastdecode.validate" -}}
{{- if le (float64 .Values.terminationGracePeriodSeconds) (float64 .Values.settings.graceSeconds) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed settings.graceSeconds (%v)" .Values.terminationGracePeriodSeconds .Values.settings.graceSeconds) }}
{{- end }}
{{- if .Values.kvAttention.persistentKV }}
{{- $sc := .Values.podSecurityContext }}
{{- if not (and $sc.runAsUser $sc.fsGroup) }}
{{- fail "kvAttention.persistentKV needs podSecurityContext.runAsUser and .fsGroup: the KV file is its user's only" }}
{{- end }}
{{- end }}
{{- if and .Values.gpu.enabled (lt (int .Values.gpu.count) (int .Values.gpuDense.tensorParallel)) }}
{{- fail (printf "gpuDense.tensorParallel (%v) needs as many GPUs: gpu.count is %v" .Values.gpuDense.tensorParallel .Values.gpu.count) }}
{{- end }}
{{- if .Values.router.enabled }}
{{- if not .Values.gateway.http.enabled }}
{{- fail "router.enabled needs gateway.http.enabled: the router sends to each gateway's HTTP port" }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- fail "router.enabled with tls.enabled is not supported yet: the router would have to trust the fleet's CA to reach the gateways over HTTPS" }}
{{- end }}
{{- if eq (int .Values.router.port) (int .Values.router.metricsPort) }}
{{- fail (printf "router.port (%v) must differ from router.metricsPort" .Values.router.port) }}
{{- end }}
{{- end }}
{{- if .Values.gateway.http.enabled }}
{{- $http := int .Values.gateway.http.port }}
{{- if or (eq $http (int .Values.gateway.port)) (eq $http (int .Values.metrics.port)) }}
{{- fail (printf "gateway.http.port (%d) must differ from gateway.port (%v) and metrics.port (%v)" $http .Values.gateway.port .Values.metrics.port) }}
{{- end }}
{{- end }}
{{- end }}
