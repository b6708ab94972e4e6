{{- define "rlfleet.labels" -}}
app.kubernetes.io/name: rlfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
rlfleet.io/role: {{ .Values.role }}
{{- end -}}

{{- define "rlfleet.selector" -}}
app.kubernetes.io/name: rlfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlfleet.name" -}}
{{ .Release.Name }}-operator
{{- end -}}
