{{- define "specrouter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specrouter.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "specrouter.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "specrouter.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "specrouter.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "specrouter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* selector labels of one component: (dict "ctx" . "component" "router") */}}
{{- define "specrouter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specrouter.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specrouter.adminSecretName" -}}
{{- .Values.adminToken.existingSecret | default (printf "%s-admin" (include "specrouter.fullname" .)) }}
{{- end }}

{{/* Secret of the bundled Redis's password, or of an external Redis URL that has one */}}
{{- define "specrouter.redisSecretName" -}}
{{- if and .Values.redis.bundled .Values.redis.existingSecret }}
{{- .Values.redis.existingSecret }}
{{- else if and (not .Values.redis.bundled) .Values.redis.externalUrlSecret.name }}
{{- .Values.redis.externalUrlSecret.name }}
{{- else }}
{{- printf "%s-redis" (include "specrouter.fullname" .) }}
{{- end }}
{{- end }}

{{/* "true" when the external Redis URL carries a password (redis://[user]:password@host) */}}
{{- define "specrouter.externalUrlHasPassword" -}}
{{- if regexMatch "^rediss?://[^/@]*:[^/@]+@" (.Values.redis.externalUrl | default "") }}true{{ end }}
{{- end }}

{{/* The router's SPECROUTER_REDIS_URL env entry (plus the password it is built from): a
     password never appears in a manifest, only in a Secret. Kubernetes expands
     $(REDIS_PASSWORD) from the entry defined before it. */}}
{{- define "specrouter.redisEnv" -}}
{{- if .Values.redis.bundled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "specrouter.redisSecretName" . }}, key: redis-password}
- name: SPECROUTER_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis:6379/0" (include "specrouter.fullname" .) | quote }}
{{- else if .Values.redis.externalUrlSecret.name }}
- name: SPECROUTER_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.redis.externalUrlSecret.name }}, key: {{ .Values.redis.externalUrlSecret.key }}}
{{- else if include "specrouter.externalUrlHasPassword" . }}
- name: SPECROUTER_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ include "specrouter.redisSecretName" . }}, key: redis-url}
{{- else }}
- name: SPECROUTER_REDIS_URL
  value: {{ required "redis.externalUrl or redis.externalUrlSecret.name is required when redis.bundled=false" .Values.redis.externalUrl | quote }}
{{- end }}
{{- end }}

{{/* The router's backends as JSON: router.extraBackends, then the engine pods' servers */}}
{{- define "specrouter.backendList" -}}
{{- $out := list }}
{{- range .Values.router.extraBackends }}
{{- $out = append $out . }}
{{- end }}
{{- if .Values.engines.enabled }}
{{- range $i := until (int $.Values.engines.pairs) }}
{{- $host := include "specrouter.engineHost" (dict "ctx" $ "index" $i) }}
{{- $group := printf "gpu%d" $i }}
{{- $out = append $out (dict "name" (printf "%s-eagle" $group) "url" (printf "http://%s:%v" $host $.Values.engines.eagle.port) "pool" "eagle" "group" $group) }}
{{- $out = append $out (dict "name" (printf "%s-baseline" $group) "url" (printf "http://%s:%v" $host $.Values.engines.baseline.port) "pool" "baseline" "group" $group) }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* "true" when a backend carries an API key: the backend list then lives in a Secret */}}
{{- define "specrouter.backendsInSecret" -}}
{{- range .Values.router.extraBackends }}{{ if .api_key }}true{{ end }}{{ end }}
{{- end }}

{{/* DNS name of engine pod i, stable through the headless service */}}
{{- define "specrouter.engineHost" -}}
{{- $name := printf "%s-engine" (include "specrouter.fullname" .ctx) -}}
{{- printf "%s-%d.%s.%s.svc.cluster.local" $name (int .index) $name .ctx.Release.Namespace }}
{{- end }}

{{- define "specrouter.engineEnv" -}}
- {name: PYTHONUNBUFFERED, value: "1"}
{{- if .Values.engines.hfTokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ .Values.engines.hfTokenSecret }}, key: token}
{{- end }}
{{- end }}

{{- define "specrouter.engineMounts" -}}
- {name: dshm, mountPath: /dev/shm}
- {name: model-cache, mountPath: /root/.cache/huggingface}
{{- end }}
