package envpool

import (
	"fmt"
	"sort"
	"time"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/egress"
)

// CheckpointKind says why the Manager took a checkpoint (the ledger's kinds).
type CheckpointKind string

// Kinds of the checkpoints the Manager takes.
const (
	KindPool     CheckpointKind = "pool"     // an env's initial state after setup
	KindTask     CheckpointKind = "task"     // a task's state after its reset hook
	KindEvaluate CheckpointKind = "evaluate" // the state the verifier ran on in Evaluate
)

// Env is one catalog entry and its warm pool. Its spec is immutable: replacing an env makes a
// new Env, and the sandboxes leased from the old one keep a pointer to it.
type Env struct {
	spec        *deltagymv1.EnvSpec
	pool        *pool
	stepTimeout time.Duration
	outputCap   int
	tasks       *taskCache
	// egress serves the env's sandboxes' outbound connections; nil when its spec allows none.
	egress *envEgress
}

// Name returns the env's catalog name.
func (e *Env) Name() string { return e.spec.GetName() }

// Spec returns a copy of the env's spec.
func (e *Env) Spec() *deltagymv1.EnvSpec { return cloneSpec(e.spec) }

// ProcessMode is how the env's checkpoints capture live processes by default.
func (e *Env) ProcessMode() deltagymv1.ProcessMode { return e.spec.GetProcessMode() }

// StepTimeout returns the default and maximum wall time of one step.
func (e *Env) StepTimeout() time.Duration { return e.stepTimeout }

// OutputCap returns the cap on each of stdout, stderr and read_file content of one step.
func (e *Env) OutputCap() int { return e.outputCap }

// MaxSteps returns the episode step budget (0: none).
func (e *Env) MaxSteps() int { return int(e.spec.GetBudgets().GetMaxSteps()) }

// MaxDuration returns the episode time budget (0: none).
func (e *Env) MaxDuration() time.Duration {
	return time.Duration(e.spec.GetBudgets().GetMaxSeconds() * float64(time.Second))
}

// Task returns the env's task text.
func (e *Env) Task() string { return e.spec.GetTask() }

// HasVerifier reports whether the env defines a verifier.
func (e *Env) HasVerifier() bool { return e.spec.GetVerifier() != "" }

// Pristine reports whether the env's verifier runs in a fresh sandbox
// (VERIFIER_MODE_PRISTINE).
func (e *Env) Pristine() bool {
	return e.spec.GetEvaluation().GetMode() == deltagymv1.VerifierMode_VERIFIER_MODE_PRISTINE
}

// Warm returns the number of warm sandboxes ready now.
func (e *Env) Warm() int { return len(e.pool.warm) }

// InitialCheckpoint returns the env's pool checkpoint, or "" while it is being built or if
// setup failed.
func (e *Env) InitialCheckpoint() string {
	select {
	case <-e.pool.ready:
		return e.pool.ckpt
	default:
		return ""
	}
}

// Err returns why the env's pool could not be warmed, or nil.
func (e *Env) Err() error {
	select {
	case <-e.pool.ready:
		return e.pool.err
	default:
		return nil
	}
}

// Waiting returns why the env's setup waits for capacity (a cap of the server refused it; it is
// retried), or nil: once ready or broken, and while its first setup runs. It wraps the cap's
// refusal (class ResourceExhausted).
func (e *Env) Waiting() error {
	if w := e.pool.waitingErr(); w != nil {
		return fmt.Errorf("%s: %w", w.what, w.cause)
	}
	return nil
}

// sandboxSpec is the runtime spec of the env's sandboxes (Image set; clear it to fork).
func (e *Env) sandboxSpec() sandbox.Spec {
	l := e.spec.GetLimits()
	env := make([]string, 0, len(e.spec.GetEnv())+len(proxyVars))
	for k, v := range e.spec.GetEnv() {
		env = append(env, k+"="+v)
	}
	if e.egress != nil {
		for _, k := range proxyVars {
			if _, ok := e.spec.GetEnv()[k]; !ok {
				env = append(env, k+"="+egress.ProxyURL)
			}
		}
	}
	sort.Strings(env)
	return sandbox.Spec{
		Image: e.spec.GetImage(),
		Limits: sandbox.Limits{
			MemoryBytes: l.GetMemoryBytes(), Pids: int64(l.GetPids()), CPUs: l.GetCpus(), DiskBytes: l.GetDiskBytes(),
		},
		Hostname: e.spec.GetName(),
		Env:      env,
		Workdir:  e.spec.GetWorkdir(),
		Egress:   e.egressServer(),
	}
}

// egressServer is the sandbox spec's Egress: nil (not a nil *envEgress) when the env has none.
func (e *Env) egressServer() sandbox.EgressServer {
	if e.egress == nil {
		return nil
	}
	return e.egress
}

// forkSpec is the runtime spec for forking a checkpoint of the env (the image is the
// checkpoint's).
func (e *Env) forkSpec() sandbox.Spec {
	s := e.sandboxSpec()
	s.Image = ""
	return s
}
