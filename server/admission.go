package server

import (
	"errors"
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// Admission is the server-wide caps on what the sandbox runtime holds at once
// (sandbox.Caps): a request beyond one is refused with resource_exhausted before anything is
// made, naming the cap, its value and the flag below that raises it. A zero field is derived
// from the machine at start (sandbox.HostCaps, from RLIMIT_NOFILE, kernel.pid_max,
// fs.mount-max and the memory); a negative one means no cap.
type Admission struct {
	// Sandboxes caps the live sandboxes (--max-sandboxes).
	Sandboxes int
	// Checkpoints caps the checkpoints held (--max-checkpoints).
	Checkpoints int
	// CheckpointBytes caps the bytes of sealed layers and process images of every checkpoint
	// (--max-checkpoint-bytes); derived: half the machine's memory (layers are tmpfs).
	CheckpointBytes int64
	// CheckpointTTL releases the checkpoints no live sandbox descends from, no pool or task cache
	// keeps, and no call has taken, restored or forked from for this long (--checkpoint-ttl).
	// Default 1h; negative: never.
	CheckpointTTL time.Duration
	// Descriptors caps the server's descriptors (--max-descriptors); derived: RLIMIT_NOFILE,
	// raised to its hard limit at start, less a reserve for connections and the ledger.
	Descriptors int
	// Mounts caps the layer mounts in the server's mount namespace (--max-mounts); derived:
	// fs.mount-max less the mounts at start and a reserve.
	Mounts int
	// SandboxMemoryBytes caps the memory of the sandboxes' control group, which also holds the
	// pages of layers written by sandboxes since closed (--sandboxes-memory); derived: the
	// machine's memory less an eighth (at least 1 GiB).
	SandboxMemoryBytes int64
	// CPUWeight is each sandbox's CPU weight (--sandbox-cpu-weight, 1 to 10000). Default 100.
	CPUWeight int
	// WarmInits bounds the ready sandbox inits kept for fork fan-outs (--warm-inits): the pool
	// grows to the largest Fork asked for, up to this, within the caps, and halves every two
	// minutes no fan-out asks for it. Default 1,024 (the largest Fork); negative: none.
	WarmInits int
}

// defaultCheckpointTTL is Admission.CheckpointTTL when unset.
const defaultCheckpointTTL = time.Hour

// capFlags are the flags that raise each cap, named in refusals.
var capFlags = map[sandbox.Cap]string{
	sandbox.CapSandboxes:       "deltagym serve --max-sandboxes",
	sandbox.CapCheckpoints:     "deltagym serve --max-checkpoints",
	sandbox.CapCheckpointBytes: "deltagym serve --max-checkpoint-bytes",
	sandbox.CapDescriptors:     "deltagym serve --max-descriptors (within RLIMIT_NOFILE)",
	sandbox.CapMounts:          "deltagym serve --max-mounts (within fs.mount-max)",
}

func (a *Admission) registerFlags(fs *flag.FlagSet) {
	count := func(p *int, name, what string) {
		fs.Func(name, fmt.Sprintf("cap on %s: a request beyond it is refused with resource_exhausted before anything is made (0, the default: derived from the machine at start; -1: no cap)", what),
			func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < -1 {
					return fmt.Errorf("%q: a number, 0 to derive it from the machine, or -1 for no cap", v)
				}
				*p = n
				return nil
			})
	}
	count(&a.Sandboxes, "max-sandboxes", "live sandboxes (derived from RLIMIT_NOFILE, kernel.pid_max, fs.mount-max and the memory)")
	count(&a.Checkpoints, "max-checkpoints", "checkpoints held")
	count(&a.Descriptors, "max-descriptors", "the server's descriptors (derived from RLIMIT_NOFILE, raised to its hard limit at start)")
	count(&a.Mounts, "max-mounts", "layer mounts in the server's mount namespace (derived from fs.mount-max)")
	size := func(p *int64, name, what string) {
		fs.Func(name, what+": a size such as 8GiB (0, the default: derived from the machine's memory; -1: no cap)", func(v string) error {
			if v == "-1" {
				*p = -1
				return nil
			}
			n, err := parseBytes(v)
			if err != nil || n < 0 {
				return fmt.Errorf("%q: a size in bytes, such as 8GiB, 0 to derive it from the machine, or -1 for no cap", v)
			}
			*p = n
			return nil
		})
	}
	size(&a.CheckpointBytes, "max-checkpoint-bytes", "cap on the bytes of every checkpoint's sealed layers and process images (derived: half the memory)")
	size(&a.SandboxMemoryBytes, "sandboxes-memory", "memory cap of the sandboxes' control group, which keeps the pages of layers written by closed sandboxes (derived: the memory less an eighth)")
	fs.Func("checkpoint-ttl", "release a checkpoint no live sandbox descends from, no pool keeps and no call has taken, restored or forked from for this `duration` (default 1h; 0: never)",
		func(v string) error {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return fmt.Errorf("%q: a duration such as 30m or 24h, or 0 to keep checkpoints until released", v)
			}
			a.CheckpointTTL = d
			if d == 0 {
				a.CheckpointTTL = -1
			}
			return nil
		})
	fs.Func("warm-inits", "keep up to `n` sandbox inits ready for fork fan-outs: the pool grows to the largest Fork asked for, within the caps, and halves every two minutes no fan-out asks for it (default 1024; 0: none)",
		func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || n > 1024 {
				return fmt.Errorf("%q: a number of inits from 0 (none) to 1024 (the largest Fork)", v)
			}
			a.WarmInits = n
			if n == 0 {
				a.WarmInits = -1
			}
			return nil
		})
	fs.IntVar(&a.CPUWeight, "sandbox-cpu-weight", max(a.CPUWeight, 100), "each sandbox's share of a busy CPU against the others (cgroup cpu.weight, 1 to 10000)")
}

func (a *Admission) check() error {
	if a.CPUWeight < 0 || a.CPUWeight > 10000 {
		return fmt.Errorf("server: --sandbox-cpu-weight %d: from 1 to 10000", a.CPUWeight)
	}
	if a.Sandboxes < -1 || a.Checkpoints < -1 || a.Descriptors < -1 || a.Mounts < -1 || a.CheckpointBytes < -1 || a.SandboxMemoryBytes < -1 {
		return errors.New("server: an admission cap below -1 (0 derives it from the machine, -1 means none)")
	}
	return nil
}

// runtimeConfig fills in the admission part of the sandbox runtime's config: the caps, the
// checkpoint budget (derived from host when unset), the TTL and the group's limits.
func (a *Admission) runtimeConfig(c *sandbox.Config, host sandbox.Host) {
	c.Caps = sandbox.Caps{Sandboxes: a.Sandboxes, Checkpoints: a.Checkpoints, Descriptors: a.Descriptors, Mounts: a.Mounts}
	c.CapFlags = capFlags
	switch {
	case a.CheckpointBytes > 0:
		c.CheckpointBudgetBytes = a.CheckpointBytes
	case a.CheckpointBytes == 0:
		c.CheckpointBudgetBytes = sandbox.HostCaps(host).CheckpointBytes
	}
	switch {
	case a.CheckpointTTL > 0:
		c.CheckpointTTL = a.CheckpointTTL
	case a.CheckpointTTL == 0:
		c.CheckpointTTL = defaultCheckpointTTL
	}
	c.MemoryBytes = a.SandboxMemoryBytes
	c.CPUWeight = a.CPUWeight
	c.InitPool = a.WarmInits
}
