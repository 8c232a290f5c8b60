package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// nodesCmd is `deltagym nodes`: every node of the cluster --addr names, as it last reported
// itself (NodeService.GetNode), or the one server --addr names.
type nodesCmd struct{}

func (*nodesCmd) Run(ctx context.Context, a *app) error {
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	nodes, err := c.nodes(ctx)
	if err != nil {
		return err
	}
	var down []error
	for _, n := range nodes {
		if n.Err != nil {
			down = append(down, &deltagym.NodeError{Node: n.Name, Addr: n.Addr, Err: n.Err})
		}
	}
	if a.JSON {
		for _, n := range nodes {
			if n.Err == nil {
				if err := printJSON(a.stdout, &deltagymv1.GetNodeResponse{Node: n.Report}); err != nil {
					return err
				}
			}
		}
	} else if err := printNodes(a.stdout, nodes); err != nil {
		return err
	}
	if len(down) > 0 {
		return fmt.Errorf("%d of %d nodes unreachable: %w", len(down), len(nodes), errors.Join(down...))
	}
	return nil
}

// printNodes writes a table of the nodes: what each reported last, and whether it answers.
func printNodes(w io.Writer, nodes []deltagym.NodeStatus) error {
	t := newTable(w, "NAME", "ADDRESS", "VERSION", "DRAINING", "SANDBOXES", "CHECKPOINTS", "CPU LOAD", "MEMORY AVAILABLE", "STATUS")
	for _, n := range nodes {
		r := n.Report
		status := "ok"
		switch {
		case n.Err != nil:
			status = "unreachable: " + shortText(oneLine(unreachableCause(n.Err)), 80)
		case !n.Listed:
			status = "no longer listed: takes no new sandboxes"
		}
		if r == nil {
			t.row(orDash(n.Name), n.Addr, "-", "-", "-", "-", "-", "-", status)
			continue
		}
		sandboxes := strconv.Itoa(int(r.GetSandboxes()))
		if m := r.GetMaxSandboxes(); m > 0 {
			sandboxes += "/" + strconv.Itoa(int(m))
		}
		t.row(n.Name, n.Addr, orDash(r.GetVersion()), yesNo(r.GetDraining()), sandboxes, strconv.Itoa(int(r.GetCheckpoints())),
			fmt.Sprintf("%.2f of %d CPUs", r.GetCpuLoad(), r.GetCpus()), formatMemory(r.GetMemoryAvailableBytes(), r.GetMemoryTotalBytes()), status)
	}
	return t.flush()
}

// formatMemory prints available memory of total, in GiB: "15.2 of 23.4 GiB".
func formatMemory(available, total int64) string {
	if total <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f of %.1f GiB", float64(available)/(1<<30), float64(total)/(1<<30))
}

// unreachableCause says why a node does not answer: the message of a transport's Unavailable,
// else the whole error (a node that refuses the token is unauthenticated).
func unreachableCause(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) && ce.Code() == connect.CodeUnavailable && ce.Message() != "" {
		return ce.Message()
	}
	return err.Error()
}
