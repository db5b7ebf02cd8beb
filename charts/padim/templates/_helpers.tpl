{{/* The release's name for every object: RELEASE-padim, or RELEASE when it already says padim. */}}
{{- define "padim.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "padim.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "padim.labels" -}}
{{ include "padim.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "padim.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "padim.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Whether more than one pod may run (a fixed count above 1, or an autoscaler): "true" or "". */}}
{{- define "padim.replicated" -}}
{{- if or (gt (int .Values.replicaCount) 1) (ne .Values.autoscaling.mode "none") -}}true{{- end -}}
{{- end -}}

{{/* The repository's claim: the user's, or the chart's. */}}
{{- define "padim.modelsClaim" -}}
{{- default (printf "%s-models" (include "padim.fullname" .)) .Values.models.volume.existingClaim -}}
{{- end -}}

{{- define "padim.recordClaim" -}}
{{- default (printf "%s-record" (include "padim.fullname" .)) .Values.record.volume.existingClaim -}}
{{- end -}}

{{/* The queue the autoscalers read: images waiting for a batch, summed over a pod's models. */}}
{{- define "padim.queueQuery" -}}
sum(padim_queue_depth{namespace="{{ .Release.Namespace }}", service="{{ include "padim.fullname" . }}"})
{{- end -}}
