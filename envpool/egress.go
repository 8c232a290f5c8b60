package envpool

import (
	"io"
	"net"

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
}

var _ sandbox.EgressServer = (*envEgress)(nil)

// ServeEgress implements sandbox.EgressServer.
func (e *envEgress) ServeEgress(ln net.Listener, sandboxID string) io.Closer {
	return e.proxy.Serve(ln, egress.Target{Env: e.env, Sandbox: sandboxID, Policy: e.policy})
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
	e.egress = &envEgress{proxy: proxy, env: e.spec.GetName(), policy: pol}
	return nil
}
