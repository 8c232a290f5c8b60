package server

// Unexported functions the external tests use.
var (
	InfraFailure  = infraFailure
	TraceExporter = traceExporter
)

// PostgresMemoryLimit is postgresMemoryLimit, for tests.
func (c *Config) PostgresMemoryLimit() int64 { return c.postgresMemoryLimit() }
