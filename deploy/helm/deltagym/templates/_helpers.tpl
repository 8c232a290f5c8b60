{{/* Names, labels and the values derived from several others. */}}

{{- define "deltagym.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The full name: the release's, with the chart's name unless it holds it already. Short
enough for every suffix below ("-postgres", "-nodes") to stay within 63 characters. */}}
{{- define "deltagym.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "deltagym.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "deltagym.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: deltagym
{{- end -}}

{{/* The node pods' selector: the DaemonSet's, the Services', the PDB's and the
NetworkPolicy's. */}}
{{- define "deltagym.nodeSelectorLabels" -}}
app.kubernetes.io/name: {{ include "deltagym.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node
{{- end -}}

{{- define "deltagym.postgresSelectorLabels" -}}
app.kubernetes.io/name: {{ include "deltagym.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: postgres
{{- end -}}

{{- define "deltagym.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "deltagym.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "deltagym.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The headless Service that lists the nodes, and the name the nodes resolve to find their
peers (--peers). */}}
{{- define "deltagym.nodesService" -}}
{{- printf "%s-nodes" (include "deltagym.fullname" .) -}}
{{- end -}}

{{- define "deltagym.peers" -}}
{{- printf "dns:%s.%s.svc.%s:%d" (include "deltagym.nodesService" .) .Release.Namespace .Values.clusterDomain (int .Values.node.port) -}}
{{- end -}}

{{- define "deltagym.postgresName" -}}
{{- printf "%s-postgres" (include "deltagym.fullname" .) -}}
{{- end -}}

{{/* The Secret and key of the API token. */}}
{{- define "deltagym.tokenSecret" -}}
{{- default (printf "%s-token" (include "deltagym.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "deltagym.tokenSecretKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* The Secret and key of the ledger's database URL: the user's, or the chart's, which holds
database.url or the bundled Postgres's URL. */}}
{{- define "deltagym.databaseSecret" -}}
{{- default (printf "%s-database" (include "deltagym.fullname" .)) .Values.database.existingSecret -}}
{{- end -}}

{{- define "deltagym.databaseSecretKey" -}}
{{- if .Values.database.existingSecret -}}{{ .Values.database.existingSecretKey }}{{- else -}}url{{- end -}}
{{- end -}}

{{/* --shutdown-timeout: node.shutdownSeconds, the stop after the drain. */}}
{{- define "deltagym.shutdownTimeout" -}}
{{- printf "%ds" (int .Values.node.shutdownSeconds) -}}
{{- end -}}

{{/* --drain-timeout: the grace period less the shutdown and the margin. The schema keeps all
three positive; this keeps the difference positive too. */}}
{{- define "deltagym.drainTimeout" -}}
{{- $grace := int .Values.node.terminationGracePeriodSeconds -}}
{{- $stop := add (int .Values.node.shutdownSeconds) (int .Values.node.shutdownMarginSeconds) -}}
{{- if le $grace $stop -}}
{{- fail (printf "node.terminationGracePeriodSeconds (%d) must exceed node.shutdownSeconds plus node.shutdownMarginSeconds (%d): the drain (--drain-timeout) is the difference" $grace $stop) -}}
{{- end -}}
{{- printf "%ds" (sub $grace $stop) -}}
{{- end -}}

{{/* A generated secret value that stays what the release already holds: the existing
Secret's key when there is one (lookup answers nothing to `helm template` and dry runs). */}}
{{- define "deltagym.keptRandom" -}}
{{- $secret := lookup "v1" "Secret" .namespace .name -}}
{{- if and $secret (hasKey (default dict $secret.data) .key) -}}
{{- index $secret.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum (int .length) -}}
{{- end -}}
{{- end -}}

{{/* Fails rendering on values that exclude each other, and when the ledger has no database. */}}
{{- define "deltagym.checkValues" -}}
{{- $external := or .Values.database.url .Values.database.existingSecret -}}
{{- if and .Values.database.url .Values.database.existingSecret -}}
{{- fail "database.url and database.existingSecret exclude each other: set one" -}}
{{- end -}}
{{- if and $external .Values.postgres.enabled -}}
{{- fail "an external database (database.url or database.existingSecret) and the bundled Postgres (postgres.enabled) exclude each other: set postgres.enabled=false to use the external one" -}}
{{- end -}}
{{- if not (or $external .Values.postgres.enabled) -}}
{{- fail "the ledger needs a database: set postgres.enabled=true for a bundled Postgres (trials), or database.url or database.existingSecret for an external one (production)" -}}
{{- end -}}
{{- if and .Values.auth.token .Values.auth.existingSecret -}}
{{- fail "auth.token and auth.existingSecret exclude each other: set one" -}}
{{- end -}}
{{- end -}}
