// Package egress is the outbound network of sandboxes whose env allows some: a policy (an
// allow-list of host:port) and the proxy that enforces it.
//
// A sandbox has a net namespace of its own with loopback alone, and no DNS. For an env with an
// egress policy, the proxy listens on 127.0.0.1:ProxyPort inside the sandbox's namespace: the
// listening socket is made there (Listen, by setns on a locked thread) and served by the
// server's process, which dials out from the host's namespace. Tools inside reach it through
// HTTP_PROXY and HTTPS_PROXY. The proxy resolves names itself, checks every resolved address
// (not the name: a name that resolves to a refused address is refused, whatever it resolved
// to before) and dials the address it checked. Each connection, allowed or refused, is
// reported to a Recorder.
//
// Lock order: Proxy.mu is a leaf.
package egress
