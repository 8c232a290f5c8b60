package server

// Unexported functions the external tests use.
var (
	InfraFailure  = infraFailure
	TraceExporter = traceExporter
)
