{{/* Deployment of a model service: (dict "ctx" $ "component" "draft"|"target"). */}}
{{- define "specserve.modelDeployment" -}}
{{- $ctx := .ctx }}
{{- $values := index $ctx.Values .component }}
{{- $modelPath := index $ctx.Values.models (printf "%sPath" .component) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specserve.componentName" . }}
  labels:
    {{- include "specserve.componentLabels" . | nindent 4 }}
spec:
  replicas: {{ $values.replicas }}
  selector:
    matchLabels:
      {{- include "specserve.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specserve.componentLabels" . | nindent 8 }}
        {{- with $values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "specserve.podScheduling" . | trim | nindent 6 }}
      {{- with include "specserve.modelsInitContainer" . | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "specserve.image" $ctx | quote }}
          imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
          args:
            - serve
            - {{ .component }}
            {{- include "specserve.commonArgs" . | trim | nindent 12 }}
            - --model
            - {{ printf "/models/%s" (trimPrefix "/" $modelPath) | quote }}
            - --device
            - {{ $values.device | quote }}
            - --dtype
            - {{ $values.dtype | quote }}
            - --attention
            - {{ $values.attention | quote }}
            - --attention-backend
            - {{ $values.attentionBackend | quote }}
            - --cuda-graphs
            - {{ $values.cudaGraphs | quote }}
            - --kv-budget-mb
            - {{ $values.kvBudgetMb | toString | quote }}
            - --prefix-cache-mb
            - {{ $values.prefixCacheMb | toString | quote }}
            - --session-ttl
            - {{ $values.sessionTtl | toString | quote }}
            {{- if eq .component "draft" }}
            - --prompt-lookup
            - {{ $values.promptLookup | quote }}
            - --confidence-floor
            - {{ $values.confidenceFloor | toString | quote }}
            {{- end }}
            {{- range $values.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $values.port }}
              protocol: TCP
            {{- if gt (int $ctx.Values.metrics.port) 0 }}
            - name: metrics
              containerPort: {{ $ctx.Values.metrics.port }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "specserve.env" . | trim | nindent 12 }}
          {{- include "specserve.probes" . | trim | nindent 10 }}
          resources:
            {{- include "specserve.resources" $values | nindent 12 }}
          securityContext:
            {{- toYaml $ctx.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "specserve.volumeMounts" . | trim | nindent 12 }}
      volumes:
        {{- include "specserve.volumes" . | trim | nindent 8 }}
{{- end }}
