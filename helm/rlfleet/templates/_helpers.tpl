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

{{- /* What the operator does in the namespaces it watches: the ClusterRole's rules when it
watches every namespace, each watched namespace's Role's otherwise (rbac.yaml). */ -}}
{{- define "rlfleet.workloadRules" -}}
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [create, patch]
{{- if eq .Values.role "hub" }}
# The hub runs RLRuns: their trainer (StatefulSet, its PodDisruptionBudget, the
# NetworkPolicy that admits only its own ranks and the metrics scrapers), their feed and
# evaluator (Deployments; an evaluator is deleted with its gate), and each run's NATS user
# Secrets.
- apiGroups: [rlfleet.io]
  resources: [rlruns]
  verbs: [list, watch, patch]
- apiGroups: [rlfleet.io]
  resources: [rlruns/status]
  verbs: [patch]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [list, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch]
# Each run's NATS user Secrets: applied when minted and again when renewed, deleted with
# the component they are for (an evaluator whose gate was removed).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch, delete]
{{- else }}
# A region mirrors runs and serves its InferencePools and EnvPools: rollout Deployments,
# serving Deployments read and scaled, sandbox servers behind a NetworkPolicy.
- apiGroups: [rlfleet.io]
  resources: [rlruns, inferencepools, envpools]
  verbs: [list, watch, patch]
- apiGroups: [rlfleet.io]
  resources: [rlruns/status, inferencepools/status, envpools/status]
  verbs: [patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, create, patch]
# Rollout and sandbox pods are counted; sandbox pods are given their deletion cost
# (their claims: idle servers go first). Rollout pods still terminating past a reclaim
# deadline are killed: the one rule no test of the suite reaches yet.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch]
# It applies the EnvPool tokens it mints (each run's, each pool's).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch]
{{- end }}
{{- end -}}
