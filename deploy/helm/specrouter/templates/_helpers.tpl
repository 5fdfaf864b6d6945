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

{{- define "specrouter.redisUrl" -}}
{{- if .Values.redis.bundled }}
{{- printf "redis://%s-redis:6379/0" (include "specrouter.fullname" .) }}
{{- else }}
{{- required "redis.externalUrl is required when redis.bundled=false" .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* DNS name of engine pod i, stable through the headless service */}}
{{- define "specrouter.engineHost" -}}
{{- $name := printf "%s-engine" (include "specrouter.fullname" .ctx) -}}
{{- printf "%s-%d.%s.%s.svc.cluster.local" $name (int .index) $name .ctx.Release.Namespace }}
{{- end }}

{{/* SGLang flags of one server: (dict "ctx" . "role" "eagle") */}}
{{- define "specrouter.sglangArgs" -}}
{{- $e := .ctx.Values.engines -}}
{{- $s := index $e .role -}}
- --model-path={{ $e.modelPath }}
- --host=0.0.0.0
- --port={{ $s.port }}
- --mem-fraction-static={{ $s.memFractionStatic }}
- --enable-metrics
- --max-running-requests={{ $s.maxRunningRequests }}
{{- if eq .role "eagle" }}
- --speculative-algorithm=EAGLE3
- --speculative-draft-model-path={{ $e.draftModelPath }}
- --speculative-num-steps={{ $s.speculativeNumSteps }}
- --speculative-eagle-topk={{ $s.speculativeEagleTopk }}
- --speculative-num-draft-tokens={{ $s.speculativeNumDraftTokens }}
{{- end }}
{{- range $s.extraArgs }}
- {{ . | quote }}
{{- end }}
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
