// Package envpooltest has fakes of what package envpool consumes: a sandbox runtime (Backend)
// whose sandboxes run scripted commands over a map of files, and a Clock that moves only when a
// test advances it. With them, pools, leases and their reaping are tested in milliseconds and
// without root; envpool's tests run the same cases against the real runtime, so that the fake
// keeps behaving as the real one does.
//
// A fake sandbox's state is its files (path to contents). A checkpoint copies them; a fork or a
// create from a checkpoint starts from a copy. A command runs the Script registered for its
// exact text (Backend.Script), which reads and writes the sandbox's files through its Call, as
// the shell command of the same text would in a real sandbox. Failures come on demand
// (Backend.Fail), a cap on the live sandboxes refuses as the runtime's does (Backend.LimitLive),
// and a sandbox dies on demand (Box.Kill).
package envpooltest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"time"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
)

// Op names an operation of the fake, for Fail and Calls.
type Op string

// The operations.
const (
	OpCreate     Op = "create"     // Backend.Create without a checkpoint
	OpFork       Op = "fork"       // Backend.Fork, Backend.Create from a checkpoint
	OpRelease    Op = "release"    // Backend.ReleaseCheckpoint
	OpExec       Op = "exec"       // Box.Exec
	OpCheckpoint Op = "checkpoint" // Box.CheckpointWith
	OpDestroy    Op = "destroy"    // Box.Destroy
)

// Files is a fake sandbox's state: file contents by absolute path.
type Files map[string]string

// Script runs one command in a fake sandbox and returns its result. A command that runs until it
// is cut short waits on ctx, which ends when the caller's context does, the command's timeout
// passes or its sandbox is destroyed.
type Script func(ctx context.Context, c *Call) sandbox.ExecResult

// Call is one command given to a Script.
type Call struct {
	Box *Box
	Req sandbox.ExecRequest
	env map[string]string
}

// Getenv returns the command's variable k: the request's, else the sandbox spec's.
func (c *Call) Getenv(k string) string { return c.env[k] }

// Backend is a fake envpool.Backend.
type Backend struct {
	mu sync.Mutex
	// +checklocks:mu
	images map[string]Files
	// +checklocks:mu
	ckpts map[string]*checkpoint
	// +checklocks:mu
	boxes map[string]*Box
	// +checklocks:mu
	scripts map[string]Script
	// +checklocks:mu
	faults map[Op]error
	// +checklocks:mu
	calls map[Op]int
	// +checklocks:mu
	seq int
	// +checklocks:mu
	maxLive int
}

type checkpoint struct {
	info  sandbox.CheckpointInfo
	files Files
}

var _ envpool.Backend = (*Backend)(nil)

// NewBackend returns a fake runtime with no images.
func NewBackend() *Backend {
	return &Backend{images: map[string]Files{}, ckpts: map[string]*checkpoint{}, boxes: map[string]*Box{},
		scripts: map[string]Script{}, faults: map[Op]error{}, calls: map[Op]int{}}
}

// AddImage adds (or replaces) an image whose sandboxes start with files.
func (b *Backend) AddImage(name string, files Files) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.images[name] = maps.Clone(files)
}

// Script makes command (an ExecRequest's Command, or its Argv joined by spaces) run fn.
// Commands without a script exit 127, as a shell's unknown command does.
func (b *Backend) Script(command string, fn Script) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.scripts[command] = fn
}

// Fail makes every later op fail with err (wrapped), until Fail(op, nil). A failed Destroy
// still destroys the sandbox, as the runtime's does.
func (b *Backend) Fail(op Op, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err == nil {
		delete(b.faults, op)
		return
	}
	b.faults[op] = err
}

// LimitLive caps the live sandboxes at n (0: no cap), as the runtime's sandbox cap does: a
// Create or Fork that would pass it is refused, before it makes anything, with sandbox.ErrCap
// naming the cap. Sandboxes live already stay.
func (b *Backend) LimitLive(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.maxLive = n
}

// admitLocked refuses n more sandboxes beyond the cap of LimitLive.
//
// +checklocks:b.mu
func (b *Backend) admitLocked(n int) error {
	if b.maxLive > 0 && len(b.boxes)+n > b.maxLive {
		return fmt.Errorf("%w: the server's cap %q of %d live sandboxes would be exceeded (%d in use, %d asked)",
			sandbox.ErrCap, sandbox.CapSandboxes, b.maxLive, len(b.boxes), n)
	}
	return nil
}

// Calls returns how many times op was called, failed calls included.
func (b *Backend) Calls(op Op) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.calls[op]
}

// Live returns the number of sandboxes neither destroyed nor dead.
func (b *Backend) Live() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.boxes)
}

// Boxes returns the live sandboxes.
func (b *Backend) Boxes() []*Box {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]*Box, 0, len(b.boxes))
	for _, s := range b.boxes {
		out = append(out, s)
	}
	return out
}

// Checkpoints returns the number of checkpoints not released.
func (b *Backend) Checkpoints() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.ckpts)
}

// begin counts a call of op and returns its injected failure, if any.
func (b *Backend) begin(op Op) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls[op]++
	if err := b.faults[op]; err != nil {
		return fmt.Errorf("envpooltest: injected %s failure: %w", op, err)
	}
	return nil
}

// Create starts a sandbox from spec.Image, or from spec.Checkpoint when set.
func (b *Backend) Create(ctx context.Context, spec sandbox.Spec) (envpool.Box, error) {
	if spec.Checkpoint != "" {
		out, err := b.Fork(ctx, spec.Checkpoint, 1, spec)
		if err != nil {
			return nil, err
		}
		return out[0], nil
	}
	if err := b.begin(OpCreate); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	files, ok := b.images[spec.Image]
	if !ok {
		return nil, fmt.Errorf("%w: image %q", sandbox.ErrNotFound, spec.Image)
	}
	if err := b.admitLocked(1); err != nil {
		return nil, err
	}
	return b.newBoxLocked(spec, spec.Image, "", files), nil
}

// Fork starts n sandboxes at checkpoint id.
func (b *Backend) Fork(ctx context.Context, id string, n int, spec sandbox.Spec) ([]envpool.Box, error) {
	if n < 1 || n > 1024 {
		return nil, fmt.Errorf("%w: fork count %d (1..1024)", sandbox.ErrInvalid, n)
	}
	if err := b.begin(OpFork); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	ck, ok := b.ckpts[id]
	if !ok {
		return nil, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", sandbox.ErrNotFound, id)
	}
	if spec.Image != "" && spec.Image != ck.info.Image {
		return nil, fmt.Errorf("%w: checkpoint %s is of image %s, not %s", sandbox.ErrMismatch, id, ck.info.Image, spec.Image)
	}
	if err := b.admitLocked(n); err != nil {
		return nil, err
	}
	out := make([]envpool.Box, n)
	for i := range out {
		out[i] = b.newBoxLocked(spec, ck.info.Image, id, ck.files)
	}
	return out, nil
}

// ReleaseCheckpoint forgets checkpoint id.
func (b *Backend) ReleaseCheckpoint(id string) error {
	if err := b.begin(OpRelease); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.ckpts[id]; !ok {
		return fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", sandbox.ErrNotFound, id)
	}
	delete(b.ckpts, id)
	return nil
}

// +checklocks:b.mu
func (b *Backend) newBoxLocked(spec sandbox.Spec, image, head string, files Files) *Box {
	b.seq++
	env := map[string]string{}
	for _, kv := range spec.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	gen, abort := context.WithCancel(context.Background())
	s := &Box{b: b, id: fmt.Sprintf("sb-fake-%d", b.seq), image: image, env: env, files: maps.Clone(files),
		head: head, done: make(chan struct{}), gen: gen, abort: abort}
	if s.files == nil {
		s.files = Files{}
	}
	b.boxes[s.id] = s
	return s
}

// +checklocks:b.mu
func (b *Backend) addCheckpointLocked(info sandbox.CheckpointInfo, files Files) sandbox.CheckpointInfo {
	b.seq++
	info.ID = fmt.Sprintf("ck-fake-%d", b.seq)
	b.ckpts[info.ID] = &checkpoint{info: info, files: files}
	return info
}

// Box is a fake sandbox.
type Box struct {
	b     *Backend
	id    string
	image string
	env   map[string]string // the spec's environment

	gen   context.Context // cancelled when the sandbox is destroyed or dies
	abort context.CancelFunc
	done  chan struct{}

	// mu is taken before Backend.mu.
	mu sync.Mutex
	// +checklocks:mu
	files Files
	// +checklocks:mu
	head string // the checkpoint the sandbox's state descends from
	// +checklocks:mu
	depth int
	// +checklocks:mu
	closed bool
}

var _ envpool.Box = (*Box)(nil)

// ID returns the sandbox's id.
func (s *Box) ID() string { return s.id }

// Image returns the name of the sandbox's image.
func (s *Box) Image() string { return s.image }

// Done is closed once the sandbox is destroyed or dead.
func (s *Box) Done() <-chan struct{} { return s.done }

// ReadFile returns the contents of the sandbox's file p.
func (s *Box) ReadFile(p string) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.files[p]
	return v, ok
}

// WriteFile sets the contents of the sandbox's file p.
func (s *Box) WriteFile(p, data string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.files[p] = data
}

// AppendFile appends data to the sandbox's file p.
func (s *Box) AppendFile(p, data string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.files[p] += data
}

// Exec runs the Script registered for the request's command.
func (s *Box) Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if (len(req.Argv) == 0) == (req.Command == "") {
		return sandbox.ExecResult{}, fmt.Errorf("%w: exec takes argv or a command", sandbox.ErrInvalid)
	}
	if err := s.b.begin(OpExec); err != nil {
		return sandbox.ExecResult{}, err
	}
	if s.isClosed() {
		return sandbox.ExecResult{}, fmt.Errorf("%w: sandbox %s", sandbox.ErrClosed, s.id)
	}
	cmd := req.Command
	if cmd == "" {
		cmd = strings.Join(req.Argv, " ")
	}
	s.b.mu.Lock()
	fn := s.b.scripts[cmd]
	s.b.mu.Unlock()
	if req.Timeout == 0 {
		req.Timeout = sandbox.DefaultTimeout
	}
	if req.MaxOutput == 0 {
		req.MaxOutput = sandbox.DefaultMaxOutput
	}
	start := time.Now()
	if fn == nil {
		return sandbox.ExecResult{ExitCode: 127, Stderr: fmt.Appendf(nil, "sh: %s: not found (no script in the fake)\n", cmd),
			Start: start}, nil
	}
	env := maps.Clone(s.env)
	for _, kv := range req.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	// The command's context ends with the caller's, at its timeout, or with the sandbox.
	tctx, cancelTimeout := context.WithTimeoutCause(ctx, req.Timeout, errTimedOut)
	defer cancelTimeout()
	cctx, cancel := context.WithCancelCause(tctx)
	defer cancel(nil)
	stop := context.AfterFunc(s.gen, func() { cancel(errDestroyed) })
	defer stop()
	res := fn(cctx, &Call{Box: s, Req: req, env: env})
	res.Start, res.Duration = start, time.Since(start)
	res.Stdout, res.StdoutTruncated = capOutput(res.Stdout, req.MaxOutput)
	res.Stderr, res.StderrTruncated = capOutput(res.Stderr, req.MaxOutput)
	switch cause := context.Cause(cctx); {
	case cause == nil:
		return res, nil
	case errors.Is(cause, errDestroyed):
		return res, fmt.Errorf("%w: the sandbox was restored or closed", sandbox.ErrAborted)
	case errors.Is(cause, errTimedOut) && ctx.Err() == nil:
		res.TimedOut, res.ExitCode, res.Signal = true, -1, "SIGKILL"
		return res, nil
	default: // the caller's own deadline or cancellation
		return res, fmt.Errorf("command cut short: %w", context.Cause(ctx))
	}
}

var (
	errTimedOut  = errors.New("command timed out")
	errDestroyed = errors.New("sandbox destroyed")
)

func capOutput(b []byte, n int) ([]byte, bool) {
	if len(b) > n {
		return b[:n], true
	}
	return b, false
}

// CheckpointWith saves the sandbox's files as a new checkpoint. The fake has no processes: every
// mode captures files only.
func (s *Box) CheckpointWith(ctx context.Context, _ sandbox.CheckpointOptions) (sandbox.CheckpointInfo, error) {
	if err := s.b.begin(OpCheckpoint); err != nil {
		return sandbox.CheckpointInfo{}, err
	}
	if err := ctx.Err(); err != nil {
		return sandbox.CheckpointInfo{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return sandbox.CheckpointInfo{}, fmt.Errorf("%w: sandbox %s", sandbox.ErrClosed, s.id)
	}
	files := maps.Clone(s.files)
	s.depth++
	info := sandbox.CheckpointInfo{Parent: s.head, Image: s.image, SandboxID: s.id, Depth: s.depth, Created: time.Now()}
	for _, v := range files {
		info.SizeBytes += int64(len(v))
	}
	s.b.mu.Lock()
	info = s.b.addCheckpointLocked(info, files)
	s.b.mu.Unlock()
	s.head = info.ID
	return info, nil
}

// Destroy ends the sandbox, cutting short the command it runs. Destroying it again succeeds.
func (s *Box) Destroy(ctx context.Context) error {
	err := s.b.begin(OpDestroy)
	s.end()
	return err
}

// Close is Destroy: the fake's sandboxes hold nothing to tear down in the background.
func (s *Box) Close(ctx context.Context) error { return s.Destroy(ctx) }

// Kill makes the sandbox die on its own, as when its init exits: Done is closed and its commands
// are cut short.
func (s *Box) Kill() { s.end() }

func (s *Box) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *Box) end() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.mu.Unlock()
	s.abort()
	s.b.mu.Lock()
	delete(s.b.boxes, s.id)
	s.b.mu.Unlock()
	close(s.done)
}
