package envpool

import (
	"io"
	"net"
	"time"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/egress"
)

// proxyVars are the environment variables that point the sandbox's tools at the egress proxy
// (both cases: tools read one or the other). The env's own values win.
var proxyVars = []string{"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"}

// envEgress serves the egress listeners of one env's sandboxes under the env's policy.
type envEgress struct {
	proxy  *egress.Proxy
	env    string
	policy egress.Policy
	limits egress.Limits
}

var _ sandbox.EgressServer = (*envEgress)(nil)

// ServeEgress implements sandbox.EgressServer.
func (e *envEgress) ServeEgress(ln net.Listener, sandboxID string) io.Closer {
	return e.proxy.Serve(ln, egress.Target{Env: e.env, Sandbox: sandboxID, Policy: e.policy, Limits: e.limits})
}

// setEgress gives the env its egress service if its spec allows any destination.
func (e *Env) setEgress(proxy *egress.Proxy) error {
	allow := e.spec.GetEgress().GetAllow()
	if len(allow) == 0 {
		return nil
	}
	if proxy == nil {
		return badField("egress", "this server runs no egress proxy")
	}
	pol, err := egress.ParsePolicy(allow)
	if err != nil {
		return badField("egress.allow", "%v", err)
	}
	lim, err := proxy.Limits().Within(egressLimits(e.spec.GetEgress().GetLimits()))
	if err != nil {
		return badField("egress.limits", "%v (the server's are deltagym serve --egress-* flags)", err)
	}
	e.egress = &envEgress{proxy: proxy, env: e.spec.GetName(), policy: pol, limits: lim}
	return nil
}

// egressLimits are the limits an env's spec sets (0: the server's).
func egressLimits(l *deltagymv1.EgressLimits) egress.Limits {
	return egress.Limits{
		MaxConns: int(l.GetMaxConnections()), ConnsPerSecond: l.GetConnectionsPerSecond(), ConnBurst: int(l.GetConnectionBurst()),
		MaxBytesUp: l.GetMaxBytesUp(), MaxBytesDown: l.GetMaxBytesDown(),
		BytesPerSecondUp: l.GetBytesPerSecondUp(), BytesPerSecondDown: l.GetBytesPerSecondDown(),
		IdleTimeout: time.Duration(l.GetIdleTimeoutSeconds() * float64(time.Second)),
	}
}
