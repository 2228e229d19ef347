{{/* certs.mode must be one of the two the chart knows; anything else fails the render. */}}
{{- define "apportion.certManager" -}}
{{- if eq .Values.certs.mode "cert-manager" -}}
true
{{- else if ne .Values.certs.mode "controller" -}}
{{- fail (printf "certs.mode must be controller or cert-manager, got %q" .Values.certs.mode) -}}
{{- end -}}
{{- end -}}
