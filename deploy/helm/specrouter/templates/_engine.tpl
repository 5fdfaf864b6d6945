{{/* `specrouter launch-pair` arguments of an engine pod: the planner's inputs and both
servers' settings; each extraArgs item goes through as one verbatim argument. */}}
{{- define "specrouter.launchPairArgs" -}}
{{- $e := .Values.engines -}}
{{- $p := $e.plan -}}
{{- if eq (int $e.eagle.port) (int $e.baseline.port) }}
{{- fail (printf "engines.eagle.port and engines.baseline.port are both %v: the two servers of a pair share the pod's network namespace and need two ports" $e.eagle.port) }}
{{- end -}}
- --sglang-version={{ $e.sglangVersion }}
- --gpu-mem-gib={{ $p.gpuMemGib }}
- --model-gib={{ $p.modelGib }}
- --draft-gib={{ $p.draftGib }}
- --model-shape={{ $p.modelShape }}
- --eagle-kv-tokens={{ $p.eagleKvTokens }}
{{- with $p.baselineKvTokens }}
- --baseline-kv-tokens={{ . }}
{{- end }}
- --chunked-prefill-size={{ $p.chunkedPrefillSize }}
{{- if hasKey $p "headroomGib" }}
- --headroom-gib={{ $p.headroomGib }}
{{- end }}
- --model-path={{ $e.modelPath }}
- --draft-model-path={{ $e.draftModelPath }}
- --eagle-port={{ $e.eagle.port }}
- --baseline-port={{ $e.baseline.port }}
- --speculative-num-steps={{ $e.eagle.speculativeNumSteps }}
- --speculative-eagle-topk={{ $e.eagle.speculativeEagleTopk }}
- --speculative-num-draft-tokens={{ $e.eagle.speculativeNumDraftTokens }}
- --eagle-max-running-requests={{ $e.eagle.maxRunningRequests }}
- --baseline-max-running-requests={{ $e.baseline.maxRunningRequests }}
- --ready-timeout={{ $e.startupTimeoutSeconds }}
- --stop-timeout={{ $e.stopTimeoutSeconds }}
{{- range $e.eagle.extraArgs }}
- {{ printf "--eagle-arg=%s" . | quote }}
{{- end }}
{{- range $e.baseline.extraArgs }}
- {{ printf "--baseline-arg=%s" . | quote }}
{{- end }}
{{- end }}
