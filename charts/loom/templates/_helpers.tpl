{{/* Shared names and labels. */}}
{{- define "loom.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loom.selectorLabels" -}}
app.kubernetes.io/name: loom
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loom.labels" -}}
{{ include "loom.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
"true" when the operator's namespaced permissions must be granted cluster-wide: no watched namespaces
(cluster-wide operator) or a pattern among them (Kopf globs such as "team-*" or "!kube-system" match
namespaces that may not exist yet, which RoleBindings cannot follow). Otherwise "" and each listed
namespace gets a RoleBinding.
*/}}
{{- define "loom.clusterScoped" -}}
{{- $patterns := 0 -}}
{{- range .Values.watchNamespaces -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .) }}{{ $patterns = add1 $patterns }}{{ end -}}
{{- end -}}
{{- if or (empty .Values.watchNamespaces) (gt $patterns 0) }}true{{ end -}}
{{- end -}}

{{- define "loom.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/*
"true" when the replicas elect a leader through Kopf peering: asked for (peering.enabled), or more than one
replica (two standalone replicas would both reconcile every object).
*/}}
{{- define "loom.peering" -}}
{{- if or .Values.peering.enabled (gt (int .Values.replicas) 1) }}true{{ end -}}
{{- end -}}
