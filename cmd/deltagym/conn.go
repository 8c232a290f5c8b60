package main

import (
	"context"
	"errors"
	"fmt"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// conn is what the client flags name: one server, or a cluster (--addr dns:NAME:PORT, or a
// comma-separated list), whose commands route as the Go client's Cluster routes calls: to the
// node an ID names, new sandboxes to the least loaded node. Exactly one of one and cluster is
// set.
type conn struct {
	one     *deltagym.Client
	addr    string // one's address, as given
	cluster *deltagym.Cluster
}

// Close closes the client or the cluster's clients.
func (c *conn) Close() error {
	if c.cluster != nil {
		return c.cluster.Close()
	}
	return c.one.Close()
}

// owner returns the EnvService of the node that holds the sandbox or checkpoint id.
func (c *conn) owner(id string) (deltagymv1connect.EnvServiceClient, error) {
	if c.cluster == nil {
		return c.one.EnvService(), nil
	}
	cl, err := c.cluster.Owner(id)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", id, err)
	}
	return cl.EnvService(), nil
}

// place returns the EnvService of the node a new sandbox goes to.
func (c *conn) place() (deltagymv1connect.EnvServiceClient, error) {
	if c.cluster == nil {
		return c.one.EnvService(), nil
	}
	cl, err := c.cluster.Place()
	if err != nil {
		return nil, err
	}
	return cl.EnvService(), nil
}

// any returns the Client of any live node: the env catalog, the shared ledger.
func (c *conn) any() (*deltagym.Client, error) {
	if c.cluster == nil {
		return c.one, nil
	}
	return c.cluster.Any()
}

// each calls f with the Client of every node that answers, in the order of their names, and
// returns the errors of the calls and of the nodes that do not answer, joined: a node keeps
// its own env catalog and images.
func (c *conn) each(f func(node string, cl *deltagym.Client) error) error {
	if c.cluster == nil {
		return f("", c.one)
	}
	var errs []error
	for _, n := range c.cluster.Nodes() {
		if n.Err != nil {
			errs = append(errs, &deltagym.NodeError{Node: n.Name, Addr: n.Addr, Err: n.Err})
			continue
		}
		cl, err := c.cluster.NodeClient(n.Name)
		if err == nil {
			err = f(n.Name, cl)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
		}
	}
	return errors.Join(errs...)
}

// nodes returns the report of every node: the cluster's last, or the one server's now.
func (c *conn) nodes(ctx context.Context) ([]deltagym.NodeStatus, error) {
	if c.cluster != nil {
		return c.cluster.Nodes(), nil
	}
	info, err := c.one.GetNode(ctx)
	if err != nil {
		return nil, err
	}
	return []deltagym.NodeStatus{{Name: info.GetName(), Addr: c.addr, Listed: true, Report: info}}, nil
}

// listSandboxes lists the sandboxes of every node.
func (c *conn) listSandboxes(ctx context.Context, f deltagym.SandboxFilter) ([]*deltagymv1.Sandbox, error) {
	if c.cluster != nil {
		return c.cluster.ListSandboxes(ctx, f)
	}
	return c.one.ListSandboxes(ctx, f)
}

// listCheckpoints lists the checkpoints of every node.
func (c *conn) listCheckpoints(ctx context.Context, f deltagym.CheckpointFilter) ([]*deltagymv1.CheckpointSummary, error) {
	if c.cluster != nil {
		return c.cluster.ListCheckpoints(ctx, f)
	}
	return c.one.ListCheckpoints(ctx, f)
}
