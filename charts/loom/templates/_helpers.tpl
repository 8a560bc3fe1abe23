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

{{/*
An image reference: <repository>@<digest> when a digest pins it, else <repository>:<tag>, the tag defaulting to
the chart's appVersion. Argument: (dict "repository" "tag" "digest" "appVersion").
*/}}
{{- define "loom.imageRef" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository (.tag | default .appVersion) -}}
{{- end -}}
{{- end -}}

{{/*
The operator's image. Loom publishes no image, so there is no default: without image.repository or
image.registry the install fails here, naming them (values.schema.json refuses it first; this message is for
--skip-schema-validation).
*/}}
{{- define "loom.operatorImage" -}}
{{- $image := .Values.image -}}
{{- $repository := $image.repository | default (and $image.registry (printf "%s/operator" $image.registry)) -}}
{{- if not $repository -}}
{{- fail "set image.registry (the registry path `make images push` pushed Loom's images to, e.g. registry.example.com/loom) or image.repository: Loom publishes no image, so the chart has no default" -}}
{{- end -}}
{{- include "loom.imageRef" (dict "repository" $repository "tag" $image.tag "digest" $image.digest "appVersion" .Chart.AppVersion) -}}
{{- end -}}

{{/*
A workload image (LOOM_<NAME>_IMAGE): workloadImages.<key>, its repository defaulting to <image.registry>/<name>.
Argument: (list $ "<key>" "<image name>").
*/}}
{{- define "loom.workloadImage" -}}
{{- $root := index . 0 -}}
{{- $key := index . 1 -}}
{{- $image := index $root.Values.workloadImages $key | default dict -}}
{{- $registry := $root.Values.image.registry -}}
{{- $repository := $image.repository | default (and $registry (printf "%s/%s" $registry (index . 2))) -}}
{{- if not $repository -}}
{{- fail (printf "set image.registry (the registry path `make images push` pushed Loom's images to) or workloadImages.%s.repository: Loom publishes no image, so the chart has no default" $key) -}}
{{- end -}}
{{- include "loom.imageRef" (dict "repository" $repository "tag" $image.tag "digest" $image.digest "appVersion" $root.Chart.AppVersion) -}}
{{- end -}}

{{/*
"true" when the replicas elect a leader through Kopf peering: asked for (peering.enabled), or more than one
replica (two standalone replicas would both reconcile every object).
*/}}
{{- define "loom.peering" -}}
{{- if or .Values.peering.enabled (gt (int .Values.replicas) 1) }}true{{ end -}}
{{- end -}}
