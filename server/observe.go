package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/deltagym/deltagym/internal/wiretext"
)

// observability holds the server's OpenTelemetry providers: metrics exported in Prometheus
// format at /metrics, and traces (one span per RPC and per sandbox operation) exported over OTLP
// when the environment names an endpoint (traceExporter).
type observability struct {
	registry       *prometheus.Registry
	meterProvider  *sdkmetric.MeterProvider
	tracerProvider *sdktrace.TracerProvider
	tracer         trace.Tracer

	rpcDuration  metric.Float64Histogram
	opDuration   metric.Float64Histogram
	rpcErrors    metric.Int64Counter
	authRefusals metric.Int64Counter
	rpcAttrs     attrCache[rpcLabels]
	opAttrs      attrCache[opLabels]
}

type rpcLabels struct{ procedure, code string }

type opLabels struct {
	op  string
	err bool
}

// attrCache keeps the attribute set of each combination of labels, made on
// first use: making one per measurement (sorting and allocating) would be a
// measurable share of the server's CPU under the rollback load test. The
// combinations are few:
// the service's procedures and operations, times the codes.
type attrCache[K comparable] struct{ m sync.Map }

func (c *attrCache[K]) get(k K, build func() attribute.Set) metric.MeasurementOption {
	if v, ok := c.m.Load(k); ok {
		return v.(metric.MeasurementOption)
	}
	v, _ := c.m.LoadOrStore(k, metric.WithAttributeSet(build()))
	return v.(metric.MeasurementOption)
}

func newObservability() (*observability, error) {
	reg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, err
	}
	tp, err := newTracerProvider(context.Background())
	if err != nil {
		return nil, err
	}
	o := &observability{registry: reg, meterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp)),
		tracerProvider: tp}
	o.tracer = o.tracerProvider.Tracer("github.com/deltagym/deltagym/server")
	m := o.meterProvider.Meter("github.com/deltagym/deltagym/server")
	buckets := metric.WithExplicitBucketBoundaries(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
	if o.rpcDuration, err = m.Float64Histogram("deltagym.rpc.duration", metric.WithUnit("s"),
		metric.WithDescription("server-side duration of RPCs"), buckets); err != nil {
		return nil, err
	}
	if o.opDuration, err = m.Float64Histogram("deltagym.sandbox.op.duration", metric.WithUnit("s"),
		metric.WithDescription("duration of sandbox operations (reset, exec, checkpoint, restore, fork, evaluate)"), buckets); err != nil {
		return nil, err
	}
	if o.rpcErrors, err = m.Int64Counter("deltagym.rpc.errors", metric.WithDescription("RPCs that returned an error, by code")); err != nil {
		return nil, err
	}
	if o.authRefusals, err = m.Int64Counter("deltagym.auth.refused", metric.WithDescription("requests refused before any handler ran: no token, or a wrong one")); err != nil {
		return nil, err
	}
	return o, nil
}

// newTracerProvider returns the server's tracer provider, exporting spans as the standard
// OpenTelemetry environment asks (see traceExporter); without an exporter spans are not
// recorded.
func newTracerProvider(ctx context.Context) (*sdktrace.TracerProvider, error) {
	exp, err := traceExporter(ctx)
	if err != nil {
		return nil, err
	}
	if exp == nil {
		// Spans that go nowhere are not recorded: their attributes, status
		// and timing would cost a measurable share of the server's CPU
		// under the rollback load test, for nothing.
		return sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample())), nil
	}
	// service.name defaults to "deltagym"; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override.
	res, err := resource.New(ctx, resource.WithAttributes(attribute.String("service.name", "deltagym")),
		resource.WithFromEnv(), resource.WithTelemetrySDK())
	if err != nil {
		return nil, fmt.Errorf("building the trace resource: %w", err)
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}

// traceExporter returns the OTLP span exporter the standard environment variables ask for, or
// nil when they ask for none. Spans are exported when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
// OTEL_EXPORTER_OTLP_ENDPOINT is set (the serve flag --trace-endpoint sets the latter) and
// OTEL_TRACES_EXPORTER is not "none"; the protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or
// OTEL_EXPORTER_OTLP_PROTOCOL: "http/protobuf" (the default) or "grpc". Headers, timeout,
// compression and TLS come from the other OTEL_EXPORTER_OTLP_* variables.
func traceExporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	if os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" {
		return nil, nil
	}
	switch e := os.Getenv("OTEL_TRACES_EXPORTER"); e {
	case "", "otlp":
	case "none":
		return nil, nil
	default:
		return nil, fmt.Errorf("OTEL_TRACES_EXPORTER %q: want otlp or none: %w", e, ErrInvalid)
	}
	proto := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if proto == "" {
		proto = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	var (
		exp sdktrace.SpanExporter
		err error
	)
	switch proto {
	case "", "http/protobuf":
		exp, err = otlptracehttp.New(ctx)
	case "grpc":
		exp, err = otlptracegrpc.New(ctx)
	default:
		return nil, fmt.Errorf("OTLP trace protocol %q: want http/protobuf or grpc: %w", proto, ErrInvalid)
	}
	if err != nil {
		return nil, fmt.Errorf("starting the OTLP trace exporter: %w", err)
	}
	return exp, nil
}

func (o *observability) metricsHandler() http.Handler {
	return promhttp.HandlerFor(o.registry, promhttp.HandlerOpts{})
}

// traceFlushTimeout bounds how long shutdown waits for the last spans to reach the trace
// collector, so that a collector which hangs does not hold up the server's shutdown.
const traceFlushTimeout = 5 * time.Second

func (o *observability) shutdown(ctx context.Context) error {
	tctx, cancel := context.WithTimeout(ctx, traceFlushTimeout)
	defer cancel()
	var terr error
	if err := o.tracerProvider.Shutdown(tctx); err != nil {
		terr = fmt.Errorf("flushing spans to the trace collector: %w", err)
	}
	return errors.Join(o.meterProvider.Shutdown(ctx), terr)
}

// op times one sandbox operation in a span and the operation histogram; call the returned
// function with the operation's error.
func (o *observability) op(ctx context.Context, name string) (context.Context, func(error)) {
	ctx, span := o.tracer.Start(ctx, "sandbox."+name)
	start := time.Now()
	return ctx, func(err error) {
		o.opDuration.Record(ctx, time.Since(start).Seconds(), o.opAttrs.get(opLabels{name, err != nil}, func() attribute.Set {
			return attribute.NewSet(attribute.String("op", name), attribute.Bool("error", err != nil))
		}))
		if err != nil {
			span.SetStatus(codes.Error, wiretext.String(err.Error())) // exported as a protobuf string
		}
		span.End()
	}
}

func (o *observability) finish(ctx context.Context, span trace.Span, procedure string, start time.Time, err error, log *slog.Logger) {
	code := "ok"
	if err != nil {
		code = connect.CodeOf(err).String()
		span.SetStatus(codes.Error, wiretext.String(err.Error())) // exported as a protobuf string
	}
	attrs := o.rpcAttrs.get(rpcLabels{procedure, code}, func() attribute.Set {
		return attribute.NewSet(attribute.String("rpc", procedure), attribute.String("code", code))
	})
	if err != nil {
		o.rpcErrors.Add(ctx, 1, attrs)
	}
	d := time.Since(start)
	o.rpcDuration.Record(ctx, d.Seconds(), attrs)
	span.SetAttributes(attribute.String("rpc.code", code))
	span.End()
	if err != nil {
		level := slog.LevelInfo
		if ctx.Err() != nil && (connect.CodeOf(err) == connect.CodeCanceled || errors.Is(err, context.Canceled)) {
			level = slog.LevelDebug // the client went away (a stream it closed): not news
		}
		log.LogAttrs(ctx, level, "rpc error", slog.String("rpc", procedure), slog.String("code", code),
			slog.Duration("duration", d), slog.String("err", err.Error()))
	} else {
		log.LogAttrs(ctx, slog.LevelDebug, "rpc", slog.String("rpc", procedure), slog.Duration("duration", d))
	}
}

// authRefused counts a request the auth gate refused; reason is one of a few fixed phrases.
func (o *observability) authRefused(reason string) {
	o.authRefusals.Add(context.Background(), 1, metric.WithAttributes(attribute.String("reason", reason)))
}

type rpcInterceptor struct {
	o   *observability
	log *slog.Logger
}

func (o *observability) interceptor(log *slog.Logger) connect.Interceptor {
	return &rpcInterceptor{o, log}
}

func (i *rpcInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		proc := req.Spec().Procedure
		ctx, span := i.o.tracer.Start(ctx, strings.TrimPrefix(proc, "/"), trace.WithSpanKind(trace.SpanKindServer))
		start := time.Now()
		resp, err := next(ctx, req)
		i.o.finish(ctx, span, proc, start, err, i.log)
		return resp, err
	}
}

func (i *rpcInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i *rpcInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		proc := conn.Spec().Procedure
		ctx, span := i.o.tracer.Start(ctx, strings.TrimPrefix(proc, "/"), trace.WithSpanKind(trace.SpanKindServer))
		start := time.Now()
		err := next(ctx, conn)
		i.o.finish(ctx, span, proc, start, err, i.log)
		return err
	}
}
