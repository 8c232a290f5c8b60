package loadtest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// DensityConfig configures MeasureDensity.
type DensityConfig struct {
	// Addr is the server's host:port.
	Addr string
	// Token is the bearer token, if the server wants one.
	Token string
	// Env is the env of the sandboxes. Default "shell".
	Env string
	// N is the number of idle sandboxes to start. Default 1,000.
	N int
	// Batch is the number of sandboxes forked per Fork call. Default 50.
	Batch int
	// Settle is how long to wait after the last start before measuring memory. Default 2s.
	Settle time.Duration
	// MemoryCgroup, when set, is the cgroup v1 memory.usage_in_bytes file of the sandboxes'
	// parent group: what the kernel charges to the sandboxes themselves.
	MemoryCgroup string
	// ServerPID, when set, is the server whose RSS growth is reported.
	ServerPID int
}

// DensityResult is what N idle sandboxes cost.
type DensityResult struct {
	Scenario           string  `json:"scenario"` // "density"
	N                  int     `json:"sandboxes"`
	StartSeconds       float64 `json:"start_seconds"`
	MemAvailDropBytes  int64   `json:"mem_available_drop_bytes"`
	PerSandboxBytes    int64   `json:"per_sandbox_bytes"`
	CgroupBytes        int64   `json:"cgroup_charged_bytes,omitempty"`
	CgroupPerSandbox   int64   `json:"cgroup_per_sandbox_bytes,omitempty"`
	ServerRSSGrowBytes int64   `json:"server_rss_growth_bytes,omitempty"`
	LoadBefore         float64 `json:"loadavg_before"`
}

// MeasureDensity resets one sandbox, checkpoints it, forks N idle sandboxes from that
// checkpoint in batches, and reports the drop in MemAvailable per sandbox and the time to
// start them. It closes every sandbox it started.
func MeasureDensity(ctx context.Context, cfg DensityConfig) (*DensityResult, error) {
	if cfg.Addr == "" {
		return nil, fmt.Errorf("density needs a server address: %w", ErrInvalid)
	}
	if cfg.Env == "" {
		cfg.Env = "shell"
	}
	if cfg.N < 0 {
		return nil, fmt.Errorf("density: %d sandboxes: %w", cfg.N, ErrInvalid)
	}
	if cfg.N == 0 {
		cfg.N = 1000
	}
	if cfg.Batch == 0 {
		cfg.Batch = 50
	}
	if cfg.Settle == 0 {
		cfg.Settle = 2 * time.Second
	}
	conn, err := grpc.NewClient(cfg.Addr, DialOptions(cfg.Token)...)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	c := deltagymv1.NewEnvServiceClient(conn)
	r, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: cfg.Env, Run: "loadtest-density"})
	if err != nil {
		return nil, fmt.Errorf("reset: %w", err)
	}
	ids := []string{r.GetSandboxId()}
	var ckID string
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
		defer cancel()
		for _, id := range ids {
			_, _ = c.Close(cctx, &deltagymv1.CloseRequest{SandboxId: id})
		}
		if ckID != "" {
			_, _ = c.ReleaseCheckpoint(cctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: ckID})
		}
	}()
	ck, err := c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: r.GetSandboxId()})
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	ckID = ck.GetCheckpointId()
	time.Sleep(cfg.Settle) // let the warm pool refill before the baseline sample
	res := &DensityResult{Scenario: "density", N: cfg.N, LoadBefore: loadavg()[0]}
	memBefore, cgBefore, rssBefore := memAvailable(), readInt(cfg.MemoryCgroup), procRSS(cfg.ServerPID)
	start := time.Now()
	for len(ids)-1 < cfg.N {
		n := min(cfg.Batch, cfg.N-(len(ids)-1))
		f, err := c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck.GetCheckpointId()}, N: int32(n)})
		if err != nil {
			return nil, fmt.Errorf("forking sandboxes %d-%d: %w", len(ids), len(ids)+n-1, err)
		}
		ids = append(ids, f.GetSandboxIds()...)
	}
	res.StartSeconds = time.Since(start).Seconds()
	time.Sleep(cfg.Settle)
	res.MemAvailDropBytes = memBefore - memAvailable()
	res.PerSandboxBytes = res.MemAvailDropBytes / int64(cfg.N)
	if cfg.MemoryCgroup != "" {
		res.CgroupBytes = readInt(cfg.MemoryCgroup) - cgBefore
		res.CgroupPerSandbox = res.CgroupBytes / int64(cfg.N)
	}
	if cfg.ServerPID > 0 {
		res.ServerRSSGrowBytes = procRSS(cfg.ServerPID) - rssBefore
	}
	return res, nil
}

// WriteSummary prints the density result.
func (d *DensityResult) WriteSummary(w io.Writer) {
	fmt.Fprintf(w, "density: %d idle sandboxes started in %.1fs (%.0f/s); MemAvailable dropped %.0f MiB = %.0f KiB per sandbox (load average %.1f: other work moves this)\n",
		d.N, d.StartSeconds, float64(d.N)/d.StartSeconds, float64(d.MemAvailDropBytes)/(1<<20), float64(d.PerSandboxBytes)/1024, d.LoadBefore)
	if d.CgroupBytes != 0 || d.ServerRSSGrowBytes != 0 {
		fmt.Fprintf(w, "  charged to the sandboxes' cgroups %.0f KiB per sandbox; server RSS grew %.0f KiB per sandbox\n",
			float64(d.CgroupPerSandbox)/1024, float64(d.ServerRSSGrowBytes)/1024/float64(d.N))
	}
}

func memAvailable() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemAvailable:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func readInt(path string) int64 {
	if path == "" {
		return 0
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return v
}
