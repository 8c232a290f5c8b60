package deltagym

import (
	"errors"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
)

// Sentinel errors returned (wrapped) by this package. Errors from the server
// are *connect.Error values instead; use connect.CodeOf to read their code.
var (
	// ErrClientClosed means the Client was closed.
	ErrClientClosed = errors.New("deltagym client closed")
	// ErrSandboxClosed means the Sandbox handle was closed.
	ErrSandboxClosed = errors.New("sandbox handle closed")
	// ErrBadAddress means the server address given to Dial cannot be used.
	ErrBadAddress = errors.New("bad server address")
	// ErrLeaseLost means the server no longer knows the sandbox a heartbeat
	// was renewing (it was closed or reaped).
	ErrLeaseLost = errors.New("sandbox lease lost")
)

// NodeError is the cause of the Unavailable error of a call a Cluster cannot deliver to the
// node that holds its sandbox or checkpoint: the node stopped answering (its GetNode, or a
// call's connection, failed), or no node of the cluster reports the name the ID gives. Read
// it with errors.As; connect.CodeOf reports CodeUnavailable.
type NodeError struct {
	// Node is the node's name; "" for an address that never answered.
	Node string
	// Addr is the address the cluster reaches the node at; "" when no node reports the name.
	Addr string
	// Err is why.
	Err error
}

// Error says which node is unreachable and why: "node node-b (10.1.0.3:8080) is unreachable:
// dial tcp 10.1.0.3:8080: connect: connection refused".
func (e *NodeError) Error() string {
	who := "node " + e.Node
	switch {
	case e.Node == "":
		who = "the node at " + e.Addr
	case e.Addr != "":
		who += " (" + e.Addr + ")"
	}
	why := "unknown"
	var ce *connect.Error
	switch {
	case errors.As(e.Err, &ce) && ce.Code() == connect.CodeUnavailable && ce.Message() != "":
		why = ce.Message() // its code is the caller's
	case e.Err != nil:
		why = e.Err.Error()
	}
	return who + " is unreachable: " + why
}

// Unwrap returns the cause.
func (e *NodeError) Unwrap() error { return e.Err }

// ErrorReason returns the reason of the google.rpc.ErrorInfo a server attached to err (such as
// "WRONG_NODE", "DRAINING", "PROCESSES_STAY"; docs/OPERATIONS.md lists them), "" when it has
// none.
func ErrorReason(err error) string {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return ""
	}
	for _, d := range ce.Details() {
		v, derr := d.Value()
		if derr != nil {
			continue
		}
		if info, ok := v.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}
