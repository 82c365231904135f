{{/* The chart name (nameOverride wins). */}}
{{- define "diphoma-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name of every resource: fullnameOverride, else release-chart (once if they overlap);
   at most 47 characters so that suffixes like -leader-election keep names within 63. */}}
{{- define "diphoma-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "diphoma-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels every resource carries. */}}
{{- define "diphoma-operator.labels" -}}
helm.sh/chart: {{ include "diphoma-operator.chart" . }}
{{ include "diphoma-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: diphoma
{{- end }}

{{/* The labels that select the operator pods. */}}
{{- define "diphoma-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "diphoma-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "diphoma-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "diphoma-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "true" when replicas must elect a leader. */}}
{{- define "diphoma-operator.leaderElection" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{/* The labels of the `helm test` resources: the common ones, but a name of their own, so that the
   operator's ReplicaSet never adopts the test Pod and the test never calls itself. */}}
{{- define "diphoma-operator.testLabels" -}}
{{ include "diphoma-operator.labels" . | replace (printf "app.kubernetes.io/name: %s" (include "diphoma-operator.name" .)) (printf "app.kubernetes.io/name: %s-test" (include "diphoma-operator.name" .)) }}
{{- end }}

{{/* The `helm test` hook annotations: created for `helm test`, deleted once it passes (kept after a
   failure, for `kubectl logs`; replaced by the next run). */}}
{{- define "diphoma-operator.testHook" -}}
helm.sh/hook: test
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end }}
