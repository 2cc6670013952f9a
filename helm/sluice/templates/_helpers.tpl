{{/*
Chart name, truncated to a DNS label.
*/}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources. At most 52 characters: the StatefulSet's
pods carry a controller-revision-hash label of <name>-<10 characters>, and the
headless Service is <name>-headless; both must fit in 63.
*/}}
{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "sluice.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every resource.
*/}}
{{- define "sluice.labels" -}}
helm.sh/chart: {{ include "sluice.chart" . }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- end }}

{{/*
Labels selecting the release's pods.
*/}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Full name of the gateway's resources (at most 60 characters).
*/}}
{{- define "sluice.gateway.fullname" -}}
{{- printf "%s-gateway" (include "sluice.fullname" .) }}
{{- end }}

{{/*
Labels selecting the gateway's pods. Their app.kubernetes.io/name is
<name>-gateway, not the StatefulSet's: its selector (name and instance, as in
sluice.selectorLabels; immutable) and the workers' Services, PodDisruptionBudget,
NetworkPolicy and anti-affinity must not match the gateway's pods.
*/}}
{{- define "sluice.gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-gateway" (include "sluice.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{/*
Labels of every gateway resource.
*/}}
{{- define "sluice.gateway.labels" -}}
helm.sh/chart: {{ include "sluice.chart" . }}
{{ include "sluice.gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- end }}

{{/*
Where the gateway's state (its status store) lives: an emptyDir.
*/}}
{{- define "sluice.gateway.stateDir" -}}
/var/lib/sluice-gateway
{{- end }}

{{/*
Name of the headless Service that gives each pod a stable DNS name.
*/}}
{{- define "sluice.headlessServiceName" -}}
{{- printf "%s-headless" (include "sluice.fullname" .) }}
{{- end }}

{{/*
Name of the ServiceAccount the pods run as.
*/}}
{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Name of the Secret with API keys and Kafka credentials ("" when there is none).
*/}}
{{- define "sluice.secretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else if .Values.secrets.data }}
{{- include "sluice.fullname" . }}
{{- end }}
{{- end }}

{{/*
The container image: repository@digest when a digest is set, else repository:tag.
*/}}
{{- define "sluice.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Path of the rendered config inside the container.
*/}}
{{- define "sluice.configPath" -}}
/etc/sluice/config/sluice.toml
{{- end }}

{{/*
This pod's query URL, as other instances reach it through the headless Service
(POD_NAME is set from the downward API just before it).
*/}}
{{- define "sluice.advertisedUrl" -}}
{{- printf "http://$(POD_NAME).%s.%s.svc.%s:%d" (include "sluice.headlessServiceName" .) .Release.Namespace .Values.clusterDomain (int .Values.http.port) }}
{{- end }}

{{/*
The configuration as Sluice will read it, as JSON: configToml parsed, or the
`config` tree with the chart-managed keys ([app] state_dir, [http] listen) set,
and [gateway] from gateway.config while the gateway is enabled (its listen,
advertised_url and state_dir come from the gateway pods' environment).
*/}}
{{- define "sluice.effectiveConfig" -}}
{{- if .Values.configToml }}
{{- $cfg := fromToml .Values.configToml }}
{{- if hasKey $cfg "Error" }}
{{- fail (printf "configToml is not valid TOML: %s" (get $cfg "Error")) }}
{{- end }}
{{- toJson $cfg }}
{{- else }}
{{- $cfg := deepCopy (.Values.config | default dict) }}
{{- $app := get $cfg "app" | default dict }}
{{- $_ := set $app "state_dir" .Values.persistence.mountPath }}
{{- $_ := set $cfg "app" $app }}
{{- $http := dict "listen" (printf "0.0.0.0:%d" (int .Values.http.port)) }}
{{- with .Values.http.tokensFile }}
{{- $_ := set $http "tokens_file" . }}
{{- end }}
{{- with .Values.http.claimsKeyFile }}
{{- $_ := set $http "claims_key_file" . }}
{{- end }}
{{- $_ := set $cfg "http" $http }}
{{- if .Values.gateway.enabled }}
{{- $_ := set $cfg "gateway" (deepCopy (.Values.gateway.config | default dict)) }}
{{- end }}
{{- toJson $cfg }}
{{- end }}
{{- end }}

{{/*
Milliseconds Sluice may spend draining in-flight calls at a revocation or a
shutdown: [app] drain_timeout_ms, or, as Sluice derives it when unset, the
longest model timeout_ms (60000 when a model sets none) plus 5000.
*/}}
{{- define "sluice.drainMs" -}}
{{- $cfg := include "sluice.effectiveConfig" . | fromJson }}
{{- $ms := dig "app" "drain_timeout_ms" nil $cfg }}
{{- if kindIs "invalid" $ms }}
{{- $longest := 0 }}
{{- range (dig "llm" "models" list $cfg) }}
{{- $t := int64 (dig "timeout_ms" 60000 .) }}
{{- if gt $t $longest }}{{ $longest = $t }}{{ end }}
{{- end }}
{{- $ms = add $longest 5000 }}
{{- end }}
{{- int64 $ms }}
{{- end }}

{{/*
The drain in whole seconds.
*/}}
{{- define "sluice.drainSeconds" -}}
{{- div (add (include "sluice.drainMs" . | int64) 999) 1000 }}
{{- end }}

{{/*
terminationGracePeriodSeconds: the drain, the preStop sleep, and 30 s for the
final commit and closing the clients, unless set explicitly.
*/}}
{{- define "sluice.terminationGracePeriodSeconds" -}}
{{- $needed := add (include "sluice.drainSeconds" . | int64) (int64 .Values.preStopSleepSeconds) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $needed 30 }}
{{- else if lt (int64 .Values.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "terminationGracePeriodSeconds (%d) is shorter than config.app.drain_timeout_ms plus preStopSleepSeconds (%d s): pods would be killed mid-drain" (int64 .Values.terminationGracePeriodSeconds) $needed) }}
{{- else }}
{{- int64 .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/*
Checks across values that the schema cannot express, mirroring Sluice's own
validation where a mistake would otherwise only show as a crash-looping pod.
*/}}
{{- define "sluice.validate" -}}
{{- $cfg := include "sluice.effectiveConfig" . | fromJson }}
{{- if .Values.configToml }}
{{- range $section := list "kafka" "llm" }}
{{- if not (hasKey $cfg $section) }}
{{- fail (printf "configToml: the [%s] section is required" $section) }}
{{- end }}
{{- end }}
{{- $http := get $cfg "http" | default dict }}
{{- if hasKey $http "advertised_url" }}
{{- fail "configToml: remove [http] advertised_url; the chart sets it per pod (SLUICE_HTTP__ADVERTISED_URL)" }}
{{- end }}
{{- if hasKey (get $cfg "kafka" | default dict) "group_instance_id" }}
{{- fail "configToml: remove [kafka] group_instance_id; the chart sets it per pod (SLUICE_KAFKA__GROUP_INSTANCE_ID)" }}
{{- end }}
{{- $listen := get $http "listen" | default "0.0.0.0:8080" }}
{{- if not (hasSuffix (printf ":%d" (int .Values.http.port)) $listen) }}
{{- fail (printf "configToml: [http] listen (%s) must use http.port (%d), which the probes and Services use" $listen (int .Values.http.port)) }}
{{- end }}
{{- $stateDir := dig "app" "state_dir" "/var/lib/sluice" $cfg }}
{{- if ne $stateDir .Values.persistence.mountPath }}
{{- fail (printf "configToml: [app] state_dir (%s) must be persistence.mountPath (%s), where the state volume is mounted" $stateDir .Values.persistence.mountPath) }}
{{- end }}
{{- end }}
{{- $llm := get $cfg "llm" | default dict }}
{{- $providers := list }}
{{- range (get $llm "providers" | default list) }}
{{- $providers = append $providers .name }}
{{- end }}
{{- $models := list }}
{{- range (get $llm "models" | default list) }}
{{- if not (has .provider $providers) }}
{{- fail (printf "config.llm.models: model %s names provider %s, which is not in config.llm.providers" .name .provider) }}
{{- end }}
{{- $models = append $models .name }}
{{- end }}
{{- $prices := get $cfg "prices" | default dict }}
{{- range $m := $models }}
{{- if not (hasKey $prices $m) }}
{{- fail (printf "config.prices.%s is missing: every model needs a price (input, output, cached micro-dollars per million tokens)" $m) }}
{{- end }}
{{- end }}
{{- range $m, $_ := $prices }}
{{- if not (has $m $models) }}
{{- fail (printf "config.prices.%s: no such model in config.llm.models (set config.prices.%s: null to drop a default)" $m $m) }}
{{- end }}
{{- end }}
{{- $routing := get $cfg "routing" | default dict }}
{{- $refs := dict }}
{{- with $routing.default_model }}{{ $_ := set $refs "config.routing.default_model" . }}{{ end }}
{{- range $t, $m := ($routing.by_task_type | default dict) }}{{ $_ := set $refs (printf "config.routing.by_task_type.%s" $t) $m }}{{ end }}
{{- range $from, $to := ($routing.fallbacks | default dict) }}{{ $_ := set $refs (printf "config.routing.fallbacks (key %s)" $from) $from }}{{ $_ := set $refs (printf "config.routing.fallbacks.%s" $from) $to }}{{ end }}
{{- range $i, $tier := ($routing.tiers | default list) }}{{ $_ := set $refs (printf "config.routing.tiers[%d].model" $i) $tier.model }}{{ end }}
{{- range $key, $m := $refs }}
{{- if not (has $m $models) }}
{{- fail (printf "%s: unknown model %s (config.llm.models has %s)" $key $m (join ", " $models)) }}
{{- end }}
{{- end }}
{{- $taskTypes := dig "topics" "task_types" (list "summarize" "classify" "extract") $cfg }}
{{- $templates := dig "prompts" "templates" (dict "summarize" "" "classify" "" "extract" "") $cfg }}
{{- range $t := $taskTypes }}
{{- if not (hasKey $templates $t) }}
{{- fail (printf "config.topics.task_types: task type %s needs a prompt template (config.prompts.templates.%s)" $t $t) }}
{{- end }}
{{- end }}
{{- if .Values.secrets.kafkaSasl.enabled }}
{{- if not (include "sluice.secretName" .) }}
{{- fail "secrets.kafkaSasl.enabled needs a Secret: set secrets.existingSecret or the SASL keys in secrets.data" }}
{{- end }}
{{- if not .Values.secrets.existingSecret }}
{{- range $k := list .Values.secrets.kafkaSasl.usernameKey .Values.secrets.kafkaSasl.passwordKey }}
{{- if not (hasKey ($.Values.secrets.data | default dict) $k) }}
{{- fail (printf "secrets.kafkaSasl.enabled: secrets.data has no %s" $k) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- if gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas) }}
{{- fail (printf "autoscaling.minReplicas (%d) exceeds autoscaling.maxReplicas (%d)" (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- end }}
{{- if and (ne .Values.autoscaling.kafka.sasl "none") (not .Values.secrets.kafkaSasl.enabled) }}
{{- fail "autoscaling.kafka.sasl needs secrets.kafkaSasl (KEDA reads the same username and password keys)" }}
{{- end }}
{{- if and .Values.autoscaling.kafka.caKey (not (include "sluice.secretName" .)) }}
{{- fail "autoscaling.kafka.caKey needs a Secret: set secrets.existingSecret or secrets.data" }}
{{- end }}
{{- end }}
{{- $maxPoll := int64 (dig "kafka" "max_poll_interval_ms" 300000 $cfg) }}
{{- $drain := include "sluice.drainMs" . | int64 }}
{{- if ge $drain $maxPoll }}
{{- fail (printf "config.app.drain_timeout_ms (%d ms; when unset, the longest model timeout_ms plus 5000) must be below config.kafka.max_poll_interval_ms (%d ms): a revocation drains inside the rebalance" $drain $maxPoll) }}
{{- end }}
{{- $_ := include "sluice.terminationGracePeriodSeconds" . }}
{{- end }}

{{/*
TOML rendering of the `config` tree. Helm reads YAML numbers as float64, and
Sluice's integer keys reject 30000.0, so integral numbers print as integers
(Sluice's float keys accept integers). Strings are JSON-quoted, which is valid
TOML. Null values are dropped, so `key: null` removes a default.
*/}}
{{- define "sluice.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{- define "sluice.toml.value" -}}
{{- $v := . }}
{{- if kindIs "string" $v }}{{ toJson $v }}
{{- else if kindIs "bool" $v }}{{ $v }}
{{- else if or (kindIs "float64" $v) (kindIs "float32" $v) }}
{{- if eq (float64 (int64 $v)) (float64 $v) }}{{ int64 $v }}{{ else }}{{ $v }}{{ end }}
{{- else if or (kindIs "int" $v) (kindIs "int64" $v) (kindIs "int32" $v) (kindIs "uint64" $v) }}{{ $v }}
{{- else if kindIs "slice" $v }}[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "sluice.toml.value" $e }}{{ end }}]
{{- else if kindIs "map" $v }}{ {{- $first := true }}{{ range $k := keys $v | sortAlpha }}{{ if not (kindIs "invalid" (get $v $k)) }}{{ if not $first }},{{ end }}{{ $first = false }} {{ include "sluice.toml.key" $k }} = {{ include "sluice.toml.value" (get $v $k) }}{{ end }}{{ end }} }
{{- else }}{{ fail (printf "config: cannot write %v (%s) as TOML" $v (kindOf $v)) }}
{{- end }}
{{- end }}

{{/*
A table: its header (unless it only holds sub-tables, or is an empty sub-table),
its scalar keys, its sub-tables, then its arrays of tables ([[...]], elements'
tables inline).
Argument: dict "path" (list of rendered keys) "table" (map).
*/}}
{{- define "sluice.toml.table" -}}
{{- $path := .path }}
{{- $t := .table }}
{{- $scalars := list }}
{{- $tables := list }}
{{- $arrays := list }}
{{- range $k := keys $t | sortAlpha }}
{{- $v := get $t $k }}
{{- if kindIs "invalid" $v }}
{{- else if kindIs "map" $v }}{{ $tables = append $tables $k }}
{{- else if and (kindIs "slice" $v) $v (eq (include "sluice.toml.allTables" $v) "true") }}{{ $arrays = append $arrays $k }}
{{- else }}{{ $scalars = append $scalars $k }}
{{- end }}
{{- end }}
{{- if or $scalars (and (eq (len $path) 1) (not (or $tables $arrays))) }}

[{{ join "." $path }}]
{{- end }}
{{- range $k := $scalars }}
{{ include "sluice.toml.key" $k }} = {{ include "sluice.toml.value" (get $t $k) }}
{{- end }}
{{- range $k := $tables }}
{{- include "sluice.toml.table" (dict "path" (append $path (include "sluice.toml.key" $k)) "table" (get $t $k)) }}
{{- end }}
{{- range $k := $arrays }}
{{- range $e := get $t $k }}

[[{{ join "." (append $path (include "sluice.toml.key" $k)) }}]]
{{- range $ek := keys $e | sortAlpha }}
{{- if not (kindIs "invalid" (get $e $ek)) }}
{{ include "sluice.toml.key" $ek }} = {{ include "sluice.toml.value" (get $e $ek) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sluice.toml.allTables" -}}
{{- $all := true }}
{{- range . }}{{ if not (kindIs "map" .) }}{{ $all = false }}{{ end }}{{ end }}
{{- $all }}
{{- end }}

{{/*
The TOML Sluice reads: configToml as given, or the `config` tree rendered with
its sections in the order of Sluice's documentation.
*/}}
{{- define "sluice.configToml" -}}
{{- if .Values.configToml }}
{{- .Values.configToml }}
{{- else }}
{{- $cfg := include "sluice.effectiveConfig" . | fromJson }}
{{- $order := list "app" "kafka" "topics" "tasks" "llm" "prompts" "routing" "batching" "accounting" "prices" "http" "gateway" }}
{{- $rest := list }}
{{- range $k := keys $cfg | sortAlpha }}{{ if not (has $k $order) }}{{ $rest = append $rest $k }}{{ end }}{{ end }}
{{- printf "# Rendered by the %s chart from its `config` values; [http] advertised_url comes\n# from SLUICE_HTTP__ADVERTISED_URL, set per pod." .Chart.Name }}
{{- if .Values.gateway.enabled }}
{{- printf "\n# [gateway] listen, advertised_url and state_dir come from SLUICE_GATEWAY__*, set\n# per gateway pod." }}
{{- end }}
{{- range $section := concat $order $rest }}
{{- if hasKey $cfg $section }}
{{- $body := get $cfg $section }}
{{- if not (kindIs "map" $body) }}
{{- fail (printf "config.%s must be a table (a map), not %s" $section (kindOf $body)) }}
{{- end }}
{{- include "sluice.toml.table" (dict "path" (list (include "sluice.toml.key" $section)) "table" $body) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
