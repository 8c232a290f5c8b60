package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
)

// layerChunk is the size of FetchLayer's messages: large enough that a message's own cost is
// small beside its copy, small enough to stay far below every client's message limit.
const layerChunk = 1 << 20

// DescribeCheckpoint implements NodeService.DescribeCheckpoint.
func (n *nodeService) DescribeCheckpoint(ctx context.Context, req *connect.Request[deltagymv1.DescribeCheckpointRequest]) (*connect.Response[deltagymv1.DescribeCheckpointResponse], error) {
	id := req.Msg.GetCheckpointId()
	if err := checkNodeArg("checkpoint_id", id); err != nil {
		return nil, n.s.toConnect(err)
	}
	m, err := n.s.rt.CheckpointManifest(ctx, id)
	if err != nil {
		if errors.Is(err, sandbox.ErrNotFound) {
			err = errdefs.WithDetail(err, "CHECKPOINT_NOT_FOUND", "checkpoint_id", id)
		}
		return nil, n.s.toConnect(err)
	}
	m.ProcessesWhy = n.s.scrub(m.ProcessesWhy)
	p, err := manifestToProto(m)
	if err != nil {
		return nil, n.s.toConnect(err)
	}
	return connect.NewResponse(&deltagymv1.DescribeCheckpointResponse{Manifest: p}), nil
}

// FetchImages implements NodeService.FetchImages.
func (n *nodeService) FetchImages(ctx context.Context, req *connect.Request[deltagymv1.FetchImagesRequest], stream *connect.ServerStream[deltagymv1.FetchImagesResponse]) error {
	id := req.Msg.GetCheckpointId()
	if err := checkNodeArg("checkpoint_id", id); err != nil {
		return n.s.toConnect(err)
	}
	w := &chunkSender{send: func(b []byte) error { return stream.Send(&deltagymv1.FetchImagesResponse{Data: b}) }, ctx: ctx, buf: make([]byte, 0, layerChunk),
		timeout: n.s.cfg.Cluster.LayerTimeout}
	if _, err := n.s.rt.ExportImages(ctx, w, id); err != nil {
		if w.err != nil {
			return w.err
		}
		return n.s.toConnect(err)
	}
	return w.flush()
}

// FetchLayer implements NodeService.FetchLayer.
func (n *nodeService) FetchLayer(ctx context.Context, req *connect.Request[deltagymv1.FetchLayerRequest], stream *connect.ServerStream[deltagymv1.FetchLayerResponse]) error {
	d := req.Msg.GetDigest()
	if err := checkNodeArg("digest", d); err != nil {
		return n.s.toConnect(err)
	}
	w := &chunkSender{send: func(b []byte) error { return stream.Send(&deltagymv1.FetchLayerResponse{Data: b}) }, ctx: ctx, buf: make([]byte, 0, layerChunk),
		timeout: n.s.cfg.Cluster.LayerTimeout}
	if err := n.s.rt.ExportLayer(w, d); err != nil {
		if w.err != nil {
			return w.err // the client went away: its error, not the export's
		}
		return n.s.toConnect(err)
	}
	return w.flush()
}

// checkNodeArg refuses an empty checkpoint ID or digest, or one longer than any this server
// makes (episode.MaxID), so that an error about it can quote it.
func checkNodeArg(field, v string) error {
	switch {
	case v == "":
		return fmt.Errorf("%s is required: %w", field, ErrInvalid)
	case len(v) > episode.MaxID:
		return fmt.Errorf("%s of %d bytes is not one of this server (at most %d): %w", field, len(v), episode.MaxID, ErrInvalid)
	}
	return nil
}

// defaultLayerTimeout is ClusterSettings.LayerTimeout's default: a node that takes
// nothing of a layer for a minute is not reading it.
const defaultLayerTimeout = time.Minute

// sendDeadlineKey keys the http.ResponseController of a NodeService call in its context.
type sendDeadlineKey struct{}

// withSendDeadlines gives the calls of handler h (mounted at path) their response's
// controller, through which a stream sets the deadline of each message it sends.
func withSendDeadlines(path string, h http.Handler) (string, http.Handler) {
	return path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), sendDeadlineKey{}, http.NewResponseController(w))))
	})
}

// chunkSender is an io.Writer that sends what it is given as messages of up to layerChunk
// bytes (FetchLayer's, FetchImages'). A message the reader does not take within timeout ends
// the stream: a stalled reader pins neither the layer nor the buffers.
type chunkSender struct {
	send    func([]byte) error
	ctx     context.Context
	buf     []byte
	timeout time.Duration
	err     error // the first send's error: every later write fails with it
}

func (c *chunkSender) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		if c.err != nil {
			return 0, c.err
		}
		k := min(len(p), cap(c.buf)-len(c.buf))
		c.buf = append(c.buf, p[:k]...)
		p = p[k:]
		if len(c.buf) == cap(c.buf) {
			if err := c.flush(); err != nil {
				return 0, err
			}
		}
	}
	return n, nil
}

func (c *chunkSender) flush() error {
	if c.err != nil || len(c.buf) == 0 {
		return c.err
	}
	if err := c.ctx.Err(); err != nil {
		c.err = err
		return err
	}
	if rc, ok := c.ctx.Value(sendDeadlineKey{}).(*http.ResponseController); ok {
		_ = rc.SetWriteDeadline(time.Now().Add(c.timeout)) // a writer without deadlines sends as before
	}
	if err := c.send(c.buf); err != nil {
		c.err = err
		return err
	}
	c.buf = c.buf[:0]
	return nil
}

// manifestToProto is m on the wire.
func manifestToProto(m sandbox.CheckpointManifest) (*deltagymv1.CheckpointManifest, error) {
	p := &deltagymv1.CheckpointManifest{CheckpointId: m.ID, ParentId: m.Parent, Image: m.Image, ImageDigest: m.ImageDigest,
		Labels: m.Labels, CreatedAt: timestamppb.New(m.Created), Processes: int32(m.Processes),
		ImagesDigest: m.ImagesDigest, ImagesBytes: m.ImagesBytes, ProcessesWhy: m.ProcessesWhy}
	if len(m.Units) > 0 {
		b, err := json.Marshal(m.Units)
		if err != nil {
			return nil, err
		}
		p.ProcessUnits = b
	}
	for _, l := range m.Layers {
		p.Layers = append(p.Layers, &deltagymv1.LayerDescriptor{Digest: l.Digest, SizeBytes: l.Bytes})
	}
	if m.Shm != nil {
		p.Shm = &deltagymv1.LayerDescriptor{Digest: m.Shm.Digest, SizeBytes: m.Shm.Bytes}
	}
	return p, nil
}

// manifestFromProto is the manifest a peer sent, checked: every layer named by a digest, sizes
// not negative.
func manifestFromProto(p *deltagymv1.CheckpointManifest) (sandbox.CheckpointManifest, error) {
	m := sandbox.CheckpointManifest{ID: p.GetCheckpointId(), Parent: p.GetParentId(), Image: p.GetImage(), ImageDigest: p.GetImageDigest(),
		Labels: p.GetLabels(), Created: p.GetCreatedAt().AsTime(), Processes: int(p.GetProcesses()),
		ImagesDigest: p.GetImagesDigest(), ImagesBytes: p.GetImagesBytes(), ProcessesWhy: p.GetProcessesWhy()}
	if b := p.GetProcessUnits(); len(b) > 0 {
		if err := json.Unmarshal(b, &m.Units); err != nil {
			return m, fmt.Errorf("the process images of checkpoint %s: %v", m.ID, err)
		}
		if m.ImagesBytes < 0 || m.ImagesDigest == "" {
			return m, fmt.Errorf("the process images of checkpoint %s have digest %q and size %d", m.ID, m.ImagesDigest, m.ImagesBytes)
		}
	}
	ref := func(d *deltagymv1.LayerDescriptor) (sandbox.LayerRef, error) {
		if d.GetDigest() == "" || d.GetSizeBytes() < 0 {
			return sandbox.LayerRef{}, fmt.Errorf("a layer of checkpoint %s has digest %q and size %d", m.ID, d.GetDigest(), d.GetSizeBytes())
		}
		return sandbox.LayerRef{Digest: d.GetDigest(), Bytes: d.GetSizeBytes()}, nil
	}
	for _, d := range p.GetLayers() {
		l, err := ref(d)
		if err != nil {
			return m, err
		}
		m.Layers = append(m.Layers, l)
	}
	if p.GetShm() != nil {
		l, err := ref(p.GetShm())
		if err != nil {
			return m, err
		}
		m.Shm = &l
	}
	return m, nil
}

// fetchCheckpoint makes the runtime hold checkpoint id, which names another node: it asks
// that node for its manifest and the layers the runtime lacks (episode.Config.Fetch).
func (s *Server) fetchCheckpoint(ctx context.Context, id string) error {
	owner := nodeid.Node(id)
	if s.peers == nil {
		return errdefs.WithDetail(fmt.Errorf("checkpoint %s is on node %s, and this node (%s) knows no other (--peers): %w",
			id, owner, s.cfg.Cluster.Node, errdefs.ErrUnavailable), "NODE_UNAVAILABLE", "checkpoint_id", id, "node", owner)
	}
	cl, err := s.peers.NodeClient(owner)
	if err != nil {
		// Not known at the last refresh (a node started after this one asked, say): ask again.
		_ = s.peers.Refresh(ctx) // an error names the nodes it did not reach: owner may be among the others
		cl, err = s.peers.NodeClient(owner)
	}
	if err != nil {
		return errdefs.WithDetail(fmt.Errorf("checkpoint %s is on node %s, which this node (%s) cannot reach: %v: %w",
			id, owner, s.cfg.Cluster.Node, connectMessage(err), errdefs.ErrUnavailable), "NODE_UNAVAILABLE", "checkpoint_id", id, "node", owner)
	}
	addr := s.peerAddr(owner)
	peer := cl.NodeService()
	dr, err := peer.DescribeCheckpoint(ctx, connect.NewRequest(&deltagymv1.DescribeCheckpointRequest{CheckpointId: id}))
	if err != nil {
		return peerErr(err, id, owner, addr)
	}
	m, err := manifestFromProto(dr.Msg.GetManifest())
	if err != nil {
		return fmt.Errorf("node %s (%s) described checkpoint %s badly: %v: %w", owner, addr, id, err, errdefs.ErrUnavailable)
	}
	if m.ID != id {
		return fmt.Errorf("node %s (%s) described checkpoint %s as %s: %w", owner, addr, id, m.ID, errdefs.ErrUnavailable)
	}
	fetch := func(ctx context.Context, l sandbox.LayerRef) (io.ReadCloser, error) {
		ctx, cancel := context.WithCancel(ctx)
		st, err := peer.FetchLayer(ctx, connect.NewRequest(&deltagymv1.FetchLayerRequest{Digest: l.Digest}))
		if err != nil {
			cancel()
			return nil, peerErr(err, id, owner, addr)
		}
		stalled := func() error {
			return errdefs.WithDetail(fmt.Errorf("checkpoint %s is on node %s (%s), which sent nothing of layer %s for %v: %w",
				id, owner, addr, l.Digest, s.cfg.Cluster.LayerTimeout, errdefs.ErrUnavailable), "NODE_UNAVAILABLE", "checkpoint_id", id, "node", owner)
		}
		return &chunkStream[deltagymv1.FetchLayerResponse, *deltagymv1.FetchLayerResponse]{st: st, cancel: cancel, wrap: func(err error) error { return peerErr(err, id, owner, addr) },
			stall: time.AfterFunc(s.cfg.Cluster.LayerTimeout, cancel), timeout: s.cfg.Cluster.LayerTimeout, stalled: stalled}, nil
	}
	fetchImages := func(ctx context.Context) (io.ReadCloser, error) {
		ctx, cancel := context.WithCancel(ctx)
		st, err := peer.FetchImages(ctx, connect.NewRequest(&deltagymv1.FetchImagesRequest{CheckpointId: id}))
		if err != nil {
			cancel()
			return nil, peerErr(err, id, owner, addr)
		}
		stalled := func() error {
			return errdefs.WithDetail(fmt.Errorf("checkpoint %s is on node %s (%s), which sent nothing of its process images for %v: %w",
				id, owner, addr, s.cfg.Cluster.LayerTimeout, errdefs.ErrUnavailable), "NODE_UNAVAILABLE", "checkpoint_id", id, "node", owner)
		}
		return &chunkStream[deltagymv1.FetchImagesResponse, *deltagymv1.FetchImagesResponse]{st: st, cancel: cancel, wrap: func(err error) error { return peerErr(err, id, owner, addr) },
			stall: time.AfterFunc(s.cfg.Cluster.LayerTimeout, cancel), timeout: s.cfg.Cluster.LayerTimeout, stalled: stalled}, nil
	}
	if _, err := s.rt.AdoptCheckpoint(ctx, m, fetch, fetchImages); err != nil {
		return errdefs.WithDetail(err, "", "checkpoint_id", id)
	}
	return nil
}

// peerErr is the error of a call to node owner at addr about checkpoint id: what the node
// said (its not-found is the checkpoint's), or that it could not be reached.
func peerErr(err error, id, owner, addr string) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		switch ce.Code() {
		case connect.CodeNotFound:
			return errdefs.WithDetail(fmt.Errorf("checkpoint %s: node %s has no such checkpoint (released or expired): %w", id, owner, sandbox.ErrNotFound),
				"CHECKPOINT_NOT_FOUND", "checkpoint_id", id)
		case connect.CodeFailedPrecondition, connect.CodeInvalidArgument, connect.CodeResourceExhausted:
			return fmt.Errorf("node %s (%s), asked for checkpoint %s: %s: %w", owner, addr, id, ce.Message(), errdefs.ErrFailedPrecondition)
		}
	}
	return errdefs.WithDetail(fmt.Errorf("checkpoint %s is on node %s (%s), which did not answer: %v: %w", id, owner, addr, err, errdefs.ErrUnavailable),
		"NODE_UNAVAILABLE", "checkpoint_id", id, "node", owner)
}

// chunkStream reads the bytes of a stream of messages that carry data (FetchLayer's,
// FetchImages'). A peer that sends no message for timeout (stall, armed for each message) has
// its stream cancelled: the error is stalled's.
type chunkStream[M any, PM interface {
	*M
	GetData() []byte
}] struct {
	st      *connect.ServerStreamForClient[M]
	cancel  context.CancelFunc
	wrap    func(error) error
	stall   *time.Timer
	timeout time.Duration
	stalled func() error
	rest    []byte
}

func (l *chunkStream[M, PM]) Read(p []byte) (int, error) {
	for len(l.rest) == 0 {
		l.stall.Reset(l.timeout)
		ok := l.st.Receive()
		if !l.stall.Stop() {
			return 0, l.stalled()
		}
		if !ok {
			if err := l.st.Err(); err != nil {
				return 0, l.wrap(err)
			}
			return 0, io.EOF
		}
		l.rest = PM(l.st.Msg()).GetData()
	}
	n := copy(p, l.rest)
	l.rest = l.rest[n:]
	return n, nil
}

func (l *chunkStream[M, PM]) Close() error {
	l.stall.Stop()
	l.cancel()
	return l.st.Close()
}

// connectMessage is err's message without its code's words.
func connectMessage(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}
