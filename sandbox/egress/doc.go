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
// Each sandbox's use of the proxy is bounded (Limits: the server's, which an env may lower):
// connections open at once and a token bucket of new ones, bytes each way in total and a rate,
// and an idle timeout. A connection beyond a limit on connections is answered 429 and one
// made once a total is used up 403, with the limit named; one that passes a total, or stays
// idle, is cut, and its record says why. Refusals are answered and recorded within bounds of
// their own (refuseSlots, refusalRecordRate), so that a sandbox connecting in a loop costs
// the server a bounded number of goroutines and ledger rows.
//
// Lock order: Server.mu, then a bucket's mu (a token bucket's own lock, a leaf).
package egress
