package server

import (
	"context"
	"crypto/subtle"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// observability holds the server's OpenTelemetry providers: metrics exported in Prometheus
// format at /metrics, and traces (one span per RPC and per sandbox operation) for whatever span
// processor is added to tracerProvider.
type observability struct {
	registry       *prometheus.Registry
	meterProvider  *sdkmetric.MeterProvider
	tracerProvider *sdktrace.TracerProvider
	tracer         trace.Tracer

	rpcDuration metric.Float64Histogram
	opDuration  metric.Float64Histogram
	rpcErrors   metric.Int64Counter
}

func newObservability() (*observability, error) {
	reg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, err
	}
	o := &observability{registry: reg, meterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp)),
		tracerProvider: sdktrace.NewTracerProvider()}
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
	return o, nil
}

func (o *observability) metricsHandler() http.Handler {
	return promhttp.HandlerFor(o.registry, promhttp.HandlerOpts{})
}

func (o *observability) shutdown(ctx context.Context) error {
	return errors.Join(o.meterProvider.Shutdown(ctx), o.tracerProvider.Shutdown(ctx))
}

// op times one sandbox operation in a span and the operation histogram; call the returned
// function with the operation's error.
func (o *observability) op(ctx context.Context, name string) (context.Context, func(error)) {
	ctx, span := o.tracer.Start(ctx, "sandbox."+name)
	start := time.Now()
	return ctx, func(err error) {
		o.opDuration.Record(ctx, time.Since(start).Seconds(), metric.WithAttributes(attribute.String("op", name), attribute.Bool("error", err != nil)))
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

func (o *observability) finish(ctx context.Context, span trace.Span, procedure string, start time.Time, err error, log *slog.Logger) {
	code := "ok"
	if err != nil {
		code = connect.CodeOf(err).String()
		span.SetStatus(codes.Error, err.Error())
		o.rpcErrors.Add(ctx, 1, metric.WithAttributes(attribute.String("rpc", procedure), attribute.String("code", code)))
	}
	d := time.Since(start)
	o.rpcDuration.Record(ctx, d.Seconds(), metric.WithAttributes(attribute.String("rpc", procedure), attribute.String("code", code)))
	span.SetAttributes(attribute.String("rpc.code", code))
	span.End()
	if err != nil {
		log.LogAttrs(ctx, slog.LevelInfo, "rpc error", slog.String("rpc", procedure), slog.String("code", code),
			slog.Duration("duration", d), slog.String("err", err.Error()))
	} else {
		log.LogAttrs(ctx, slog.LevelDebug, "rpc", slog.String("rpc", procedure), slog.Duration("duration", d))
	}
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

// authInterceptor requires "Authorization: Bearer <token>" when token is set.
type authInterceptor string

func (a authInterceptor) check(h http.Header) error {
	if a == "" {
		return nil
	}
	got, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
	if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(a)) != 1 {
		return connect.NewError(connect.CodeUnauthenticated, ErrUnauthenticated)
	}
	return nil
}

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if err := a.check(req.Header()); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if err := a.check(conn.RequestHeader()); err != nil {
			return err
		}
		return next(ctx, conn)
	}
}
