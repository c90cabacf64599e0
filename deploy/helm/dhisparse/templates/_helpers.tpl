{{/* Names, labels and the few values several templates derive. */}}

{{- define "dhisparse.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or just <release> when it already contains the chart name. Kept to 40
characters so that "<fullname>-kv-host-store-xxxxx" pod names stay within 63. */}}
{{- define "dhisparse.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := include "dhisparse.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dhisparse.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "gateway"). */}}
{{- define "dhisparse.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dhisparse.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects: (dict "ctx" $ "component" "gateway"). */}}
{{- define "dhisparse.labels" -}}
helm.sh/chart: {{ include "dhisparse.chart" .ctx }}
{{ include "dhisparse.selectorLabels" . }}
app.kubernetes.io/part-of: dhisparse
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of objects that belong to the release as a whole. */}}
{{- define "dhisparse.releaseLabels" -}}
helm.sh/chart: {{ include "dhisparse.chart" . }}
app.kubernetes.io/name: {{ include "dhisparse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: dhisparse
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* image reference: (dict "ctx" $ "image" .Values.gateway.image) */}}
{{- define "dhisparse.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "dhisparse.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dhisparse.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dhisparse.workerName" -}}
{{- printf "%s-worker" (include "dhisparse.fullname" .) }}
{{- end }}

{{- define "dhisparse.kvHostStoreName" -}}
{{- printf "%s-kv-host-store" (include "dhisparse.fullname" .) }}
{{- end }}

{{- define "dhisparse.redisName" -}}
{{- printf "%s-redis" (include "dhisparse.fullname" .) }}
{{- end }}

{{/* The gateway's DHISPARSE_GATEWAY_WORKERS: every StatefulSet pod by its stable DNS name. */}}
{{- define "dhisparse.workerAddresses" -}}
{{- $name := include "dhisparse.workerName" . }}
{{- $addrs := list }}
{{- range $i := until (int .Values.worker.replicas) }}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.clusterDomain (int $.Values.worker.port)) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* The model as the services take it: a preset name, or a directory in the mounted volume. */}}
{{- define "dhisparse.modelSource" -}}
{{- if .Values.model.volume }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.source }}
{{- else }}
{{- .Values.model.source }}
{{- end }}
{{- end }}

{{/* The model volume and its mount, for pods and containers that read the weights. */}}
{{- define "dhisparse.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end }}
{{- define "dhisparse.modelVolumeMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* DHISPARSE_<PREFIX>_<KEY> variables from a settings map: (dict "prefix" "GATEWAY" "settings" .) */}}
{{- define "dhisparse.settingsEnv" -}}
{{- range $k, $v := .settings }}
- name: {{ printf "DHISPARSE_%s_%s" $.prefix (upper $k) }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/* The Redis URL source for the gateway: an EnvVar list item, or nothing (in-process ledger). */}}
{{- define "dhisparse.redisUrlEnv" -}}
{{- if .Values.redis.enabled }}
- name: DHISPARSE_GATEWAY_REDIS_URL
  value: {{ printf "redis://%s:%d/0" (include "dhisparse.redisName" .) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.urlSecret }}
- name: DHISPARSE_GATEWAY_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.urlSecret }}
      key: {{ .Values.redis.urlSecretKey }}
{{- else if .Values.redis.url }}
- name: DHISPARSE_GATEWAY_REDIS_URL
  value: {{ .Values.redis.url | quote }}
{{- end }}
{{- end }}

{{/* The store's node placement defaults to the workers', so every worker node has a store. */}}
{{- define "dhisparse.kvHostStoreNodeSelector" -}}
{{- default .Values.worker.nodeSelector .Values.kvHostStore.nodeSelector | toYaml }}
{{- end }}
{{- define "dhisparse.kvHostStoreTolerations" -}}
{{- default .Values.worker.tolerations .Values.kvHostStore.tolerations | toYaml }}
{{- end }}

{{/* Checks that fail the render with a message instead of producing a broken release. */}}
{{- define "dhisparse.validate" -}}
{{- if and (gt (int .Values.gateway.replicas) 1) (not (or .Values.redis.enabled .Values.redis.url .Values.redis.urlSecret)) }}
{{- fail "gateway.replicas > 1 needs a shared admission ledger: enable redis or set redis.url / redis.urlSecret" }}
{{- end }}
{{- if and .Values.gateway.autoscaling.enabled (not (or .Values.redis.enabled .Values.redis.url .Values.redis.urlSecret)) }}
{{- fail "gateway.autoscaling needs a shared admission ledger: enable redis or set redis.url / redis.urlSecret" }}
{{- end }}
{{- if and .Values.redis.enabled (or .Values.redis.url .Values.redis.urlSecret) }}
{{- fail "redis.url / redis.urlSecret name an external Redis: set redis.enabled=false to use it" }}
{{- end }}
{{- if and (hasPrefix "cuda" .Values.worker.device) (lt (int .Values.worker.gpusPerPod) 1) }}
{{- fail "worker.device=cuda needs worker.gpusPerPod >= 1" }}
{{- end }}
{{- end }}
