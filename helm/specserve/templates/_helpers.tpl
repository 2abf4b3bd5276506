{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name; components append -draft, -target, -coordinator (hence 50 characters). */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "draft"). */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specserve.componentLabels" -}}
{{ include "specserve.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Object name of one component: (dict "ctx" $ "component" "draft"). */}}
{{- define "specserve.componentName" -}}
{{- printf "%s-%s" (include "specserve.fullname" .ctx) .component }}
{{- end }}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "specserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* Endpoint spec the coordinator is given for a model component: (dict "ctx" $ "component" "target"). */}}
{{- define "specserve.endpointSpec" -}}
{{- $values := index .ctx.Values .component }}
{{- $service := include "specserve.componentName" . }}
{{- if eq .ctx.Values.discovery.mode "k8s" }}
{{- printf "k8s:///%s/%s:%d" .ctx.Release.Namespace $service (int $values.port) }}
{{- else }}
{{- printf "dns:///%s.%s.svc.%s:%d" $service .ctx.Release.Namespace .ctx.Values.clusterDomain (int $values.port) }}
{{- end }}
{{- end }}

{{/* Mount point of the TLS secret. */}}
{{- define "specserve.tlsDir" -}}/etc/specserve/tls{{- end }}

{{/* Flags every server takes: (dict "ctx" $ "component" "draft"). */}}
{{- define "specserve.commonArgs" -}}
{{- $values := index .ctx.Values .component }}
- --host
- 0.0.0.0
- --port
- {{ $values.port | int | quote }}
- --log-level
- {{ .ctx.Values.logLevel | quote }}
- --metrics-port
- {{ .ctx.Values.metrics.port | int | quote }}
{{- if .ctx.Values.tls.enabled }}
- --tls-cert
- {{ include "specserve.tlsDir" . }}/tls.crt
- --tls-key
- {{ include "specserve.tlsDir" . }}/tls.key
- --tls-ca
- {{ include "specserve.tlsDir" . }}/ca.crt
{{- if .ctx.Values.tls.mutual }}
- --tls-client-auth
{{- end }}
{{- end }}
{{- end }}

{{/* Environment every server gets: OTEL_*, scratch HOME, health-check settings. */}}
{{- define "specserve.env" -}}
{{- $values := index .ctx.Values .component }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: HOME
  value: /tmp
- name: TRITON_CACHE_DIR
  value: /tmp/triton
- name: OTEL_SERVICE_NAME
  value: {{ printf "specserve-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,service.instance.id=$(POD_NAME),k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),deployment.environment=%s" .ctx.Release.Namespace .ctx.Release.Name | quote }}
{{- with .ctx.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .ctx.Values.otel.sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ . | quote }}
{{- end }}
{{- with .ctx.Values.otel.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := .ctx.Values.otel.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
- name: SPECSERVE_HEALTH_PORT
  value: {{ $values.port | int | quote }}
{{- if .ctx.Values.tls.enabled }}
- name: SPECSERVE_TLS_CERT
  value: {{ include "specserve.tlsDir" . }}/tls.crt
- name: SPECSERVE_TLS_KEY
  value: {{ include "specserve.tlsDir" . }}/tls.key
{{- if .ctx.Values.tls.mutual }}
- name: SPECSERVE_TLS_CA
  value: {{ include "specserve.tlsDir" . }}/ca.crt
{{- end }}
- name: SPECSERVE_TLS_SERVER_NAME
  value: {{ .ctx.Values.tls.serverName | quote }}
{{- end }}
{{- end }}

{{/*
The health check of the image's HEALTHCHECK (grpc.health.v1 over TLS when SPECSERVE_TLS_* are set), for exec
probes: the kubelet's native gRPC probe cannot speak TLS.
*/}}
{{- define "specserve.healthCheckCode" -}}
import os,sys,grpc;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;e=os.environ.get;r=lambda p:open(p,'rb').read() if p else None;a='127.0.0.1:'+e('SPECSERVE_HEALTH_PORT','50050');c=grpc.secure_channel(a,grpc.ssl_channel_credentials(r(e('SPECSERVE_TLS_CA')),r(e('SPECSERVE_TLS_KEY')),r(e('SPECSERVE_TLS_CERT'))),[('grpc.ssl_target_name_override',e('SPECSERVE_TLS_SERVER_NAME','localhost'))]) if e('SPECSERVE_TLS_CERT') else grpc.insecure_channel(a);s=g.HealthStub(c).Check(h.HealthCheckRequest(),timeout=float(e('SPECSERVE_HEALTH_TIMEOUT','5'))).status;sys.exit(0 if s==h.HealthCheckResponse.SERVING else 1)
{{- end }}

{{/* startup, readiness and liveness probes of a component: native gRPC, or exec over TLS. */}}
{{- define "specserve.probes" -}}
{{- $values := index .ctx.Values .component }}
{{- range $kind := list "startupProbe" "readinessProbe" "livenessProbe" }}
{{- $probe := index $values $kind }}
{{ $kind }}:
  {{- if $.ctx.Values.tls.enabled }}
  exec:
    command:
      - python
      - -c
      - {{ include "specserve.healthCheckCode" $.ctx | quote }}
  {{- else }}
  grpc:
    port: {{ $values.port | int }}
  {{- end }}
  periodSeconds: {{ $probe.periodSeconds }}
  failureThreshold: {{ $probe.failureThreshold }}
  timeoutSeconds: {{ $probe.timeoutSeconds }}
{{- end }}
{{- end }}

{{/* resources with nvidia.com/gpu added to the limits when gpu > 0. */}}
{{- define "specserve.resources" -}}
{{- $resources := deepCopy (.resources | default dict) }}
{{- if gt (int (.gpu | default 0)) 0 }}
{{- $limits := deepCopy ($resources.limits | default dict) }}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpu) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Scheduling and security of a pod spec. */}}
{{- define "specserve.podScheduling" -}}
{{- $values := index .ctx.Values .component }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
serviceAccountName: {{ include "specserve.serviceAccountName" .ctx }}
automountServiceAccountToken: {{ and (eq .component "coordinator") (eq .ctx.Values.discovery.mode "k8s") }}
terminationGracePeriodSeconds: {{ $values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Volume mounts of a server container. */}}
{{- define "specserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if ne .component "coordinator" }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  mountPath: {{ include "specserve.tlsDir" . }}
  readOnly: true
{{- end }}
{{- if and (eq .component "coordinator") .ctx.Values.auth.enabled }}
- name: auth
  mountPath: /etc/specserve/auth
  readOnly: true
{{- end }}
{{- end }}

{{/* Volumes of a pod. */}}
{{- define "specserve.volumes" -}}
- name: tmp
  emptyDir:
    {{- with .ctx.Values.tmpSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- if ne .component "coordinator" }}
{{- $models := .ctx.Values.models }}
- name: models
  {{- if eq $models.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $models.pvc.claimName }}
    readOnly: true
  {{- else if eq $models.source "hostPath" }}
  hostPath:
    path: {{ $models.hostPath.path }}
    {{- with $models.hostPath.type }}
    type: {{ . }}
    {{- end }}
  {{- else }}
  emptyDir:
    {{- with $models.image.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
  {{- end }}
{{- end }}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .ctx.Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and (eq .component "coordinator") .ctx.Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ .ctx.Values.auth.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .ctx.Values.auth.secretKey }}
        path: token
{{- end }}
{{- end }}

{{/* models.source=image: copy the models image's directory into the models emptyDir. */}}
{{- define "specserve.modelsInitContainer" -}}
{{- $models := .ctx.Values.models }}
{{- if and (ne .component "coordinator") (eq $models.source "image") }}
initContainers:
  - name: copy-models
    image: {{ printf "%s:%s" $models.image.repository $models.image.tag | quote }}
    imagePullPolicy: {{ $models.image.pullPolicy }}
    command: ["sh", "-c", {{ printf "cp -R %s/. /specserve-models/ && ls -la /specserve-models" (trimSuffix "/" $models.image.path) | quote }}]
    securityContext:
      {{- toYaml .ctx.Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /specserve-models
{{- end }}
{{- end }}
