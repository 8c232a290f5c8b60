package loadtest

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
)

// The APIs Config.API names.
const (
	APIUnary  = "unary"
	APIStream = "stream"
)

// Scenarios lists the scenario names Run accepts.
var Scenarios = []string{"rollback", "rollback-exec", "rollback-process", "steps", "grpo", "tree", "mixed"}

// Process capture methods of the rollback-process scenario (Config.ProcessMethod).
const (
	// ProcessTemplate is the fast path: a frozen template copy of each process.
	ProcessTemplate = "template"
	// ProcessCRIU is the CRIU path (PROCESS_MODE_CRIU), measured beside the fast path
	// when the server offers it.
	ProcessCRIU = "criu"
)

// Process shapes of the rollback-process scenario (Config.ProcessShape).
const (
	// ShapeSingle is one single-threaded python3 process.
	ShapeSingle = "single"
	// ShapeThreads is one python3 process of four threads.
	ShapeThreads = "threads"
	// ShapeTree is a shell running the python3 process as its child (sh -c 'python3 …; exit').
	ShapeTree = "tree"
)

// Config configures Run.
type Config struct {
	// Addr is the server's host:port (gRPC over unencrypted HTTP/2), or a cluster target
	// (`dns:NAME:PORT`, or a comma-separated list of addresses): the run then goes through the Go
	// client's Cluster, which places each sandbox on the least loaded node, spreads each fork
	// over the nodes and sends every call to the node that holds its sandbox or checkpoint.
	Addr string
	// ClusterOptions are the Go client's options for a cluster target (its resolver, its HTTP
	// client); the token is Token.
	ClusterOptions []deltagym.Option
	// Token is the bearer token, if the server wants one.
	Token string
	// Scenario is one of Scenarios.
	Scenario string
	// Env is the env every sandbox is reset from. Default "shell".
	Env string
	// Concurrency is the number of sandboxes (and closed-loop workers). Default 64.
	Concurrency int
	// Rate, when positive, makes the run open-loop: iterations start at this many per
	// second whatever the latency (latency counts from the intended start, so queueing
	// shows); 0 is closed-loop.
	Rate float64
	// Duration is the measured time, after Warmup. Default 30s.
	Duration time.Duration
	// Warmup runs before the measured time; its results are discarded. Default 3s.
	Warmup time.Duration
	// FileSize is the size of the file the rollback scenario writes. Default 4096.
	FileSize int
	// Group is the G of the grpo scenario (children per fork). Default 8.
	Group int
	// ProcessMB is the memory, in MiB, the process of the rollback-process scenario holds
	// (every page written). Default 8.
	ProcessMB int
	// ProcessMethod is how the rollback-process scenario's checkpoints capture its
	// process: ProcessTemplate (default) or ProcessCRIU.
	ProcessMethod string
	// ProcessShape is the shape of the rollback-process scenario's processes:
	// ShapeSingle (default), ShapeThreads or ShapeTree.
	ProcessShape string
	// API is how the rollback scenarios call the server: APIUnary (default) makes the
	// restore and each step a unary call; APIStream sends a sandbox's steps on one StepStream
	// of its own, the restore carried by the first step of each iteration
	// (StepRequest.restore_checkpoint_id): the same work in fewer, lighter messages.
	API string
	// Conns is the number of HTTP/2 connections the workers share. Default 1: one connection
	// lets both ends put the frames of many streams into one write, for less of the load
	// generator's CPU per rollback and more rollbacks a second than four, on streams and in
	// unary calls (--conns; docs/PERFORMANCE.md, "The load test" and "Figures behind design
	// choices").
	Conns int
	// ServerPID, when known, is the server whose RSS and CPU the timeline samples from
	// /proc; 0 samples them from the server's /metrics.
	ServerPID int
	// SandboxCPUStat, when known, is the cgroup2 cpu.stat file accounting the CPU of every
	// sandbox of the server (Server.SandboxCPUStat).
	SandboxCPUStat string
	// SampleInterval is the interval of the timeline's samples. Default 1s.
	SampleInterval time.Duration
	// Progress receives a live progress line each second; nil for none.
	Progress io.Writer
}

// Validate checks the config and fills in defaults.
func (c *Config) Validate() error {
	if err := c.checkTarget(); err != nil {
		return err
	}
	c.Env = cmp.Or(c.Env, "shell")
	c.Concurrency = cmp.Or(c.Concurrency, 64)
	c.Duration = cmp.Or(c.Duration, 30*time.Second)
	c.Warmup = cmp.Or(c.Warmup, 3*time.Second)
	c.FileSize = cmp.Or(c.FileSize, 4096)
	c.Group = cmp.Or(c.Group, 8)
	c.ProcessMB = cmp.Or(c.ProcessMB, 8)
	c.ProcessMethod = cmp.Or(c.ProcessMethod, ProcessTemplate)
	c.ProcessShape = cmp.Or(c.ProcessShape, ShapeSingle)
	c.Conns = cmp.Or(c.Conns, 1)
	c.SampleInterval = cmp.Or(c.SampleInterval, time.Second)
	switch {
	case c.Concurrency < 1:
		return fmt.Errorf("concurrency %d is below 1: %w", c.Concurrency, ErrInvalid)
	case c.Rate < 0:
		return fmt.Errorf("rate %v is negative: %w", c.Rate, ErrInvalid)
	case c.SampleInterval < 100*time.Millisecond:
		return fmt.Errorf("sample interval %v is below 100ms: %w", c.SampleInterval, ErrInvalid)
	case c.Duration < 0 || c.Warmup < 0:
		return fmt.Errorf("duration and warm-up must not be negative: %w", ErrInvalid)
	case c.FileSize < 16:
		return fmt.Errorf("file size %d is below 16 bytes: %w", c.FileSize, ErrInvalid)
	case c.ProcessMB < 1 || c.ProcessMB > 1024:
		return fmt.Errorf("process size %d MiB is not within 1..1024: %w", c.ProcessMB, ErrInvalid)
	case c.ProcessMethod != ProcessTemplate && c.ProcessMethod != ProcessCRIU:
		return fmt.Errorf("process method %q is neither %q nor %q: %w", c.ProcessMethod, ProcessTemplate, ProcessCRIU, ErrInvalid)
	case c.ProcessShape != ShapeSingle && c.ProcessShape != ShapeThreads && c.ProcessShape != ShapeTree:
		return fmt.Errorf("process shape %q is none of %q, %q, %q: %w", c.ProcessShape, ShapeSingle, ShapeThreads, ShapeTree, ErrInvalid)
	case c.Group < 1:
		return fmt.Errorf("group %d: at least one child per fork: %w", c.Group, ErrInvalid)
	case c.Conns < 1:
		return fmt.Errorf("conns %d: at least one connection: %w", c.Conns, ErrInvalid)
	}
	return nil
}

// checkTarget checks what the run is aimed at, the scenario, the server and the API, and fills
// in their defaults.
func (c *Config) checkTarget() error {
	c.Scenario = cmp.Or(c.Scenario, "rollback")
	if !slices.Contains(Scenarios, c.Scenario) {
		return fmt.Errorf("scenario %q is not one of %s, or density: %w", c.Scenario, strings.Join(Scenarios, ", "), ErrInvalid)
	}
	if c.Addr == "" {
		return fmt.Errorf("no server address: pass --addr host:port of a running server (make run serves on 127.0.0.1:8080), or --serve bin/deltagym to start one: %w", ErrInvalid)
	}
	if deltagym.IsClusterTarget(c.Addr) {
		if err := deltagym.CheckClusterTarget(c.Addr); err != nil {
			return fmt.Errorf("cluster target %q: %w: %w", c.Addr, err, ErrInvalid)
		}
	}
	switch c.API {
	case "":
		c.API = APIUnary
	case APIUnary:
	case APIStream:
		if c.Scenario != "rollback" && c.Scenario != "rollback-exec" {
			return fmt.Errorf("api %q serves the rollback and rollback-exec scenarios, not %s: %w", c.API, c.Scenario, ErrInvalid)
		}
	default:
		return fmt.Errorf("api %q is neither %q nor %q: %w", c.API, APIUnary, APIStream, ErrInvalid)
	}
	return nil
}

// unit names what one iteration of a scenario is, for the throughput line.
func unit(scenario string) string {
	switch scenario {
	case "rollback", "rollback-exec", "rollback-process":
		return "rollbacks"
	case "steps":
		return "steps"
	case "grpo":
		return "groups"
	case "tree":
		return "tree-ops"
	}
	return "iterations"
}
