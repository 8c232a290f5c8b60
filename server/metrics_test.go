package server_test

import (
	"io"
	"net/http"
	"regexp"
	"strconv"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// scrape returns the server's /metrics.
func (b *bundle) scrape(t *testing.T) string {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), "GET", "http://"+b.addr+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+b.token)
	resp, err := http.DefaultClient.Do(req)
	must(t, err)
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %d %s", resp.StatusCode, out)
	}
	return string(out)
}

// gauge returns the value of the gauge name with labels (a regexp of the label set) in
// metrics, or -1 if it is missing.
func gauge(metrics, name, labels string) int64 {
	m := regexp.MustCompile(`(?m)^` + name + `\{` + labels + `\} ([0-9.e+]+)$`).FindStringSubmatch(metrics)
	if m == nil {
		return -1
	}
	n, _ := strconv.ParseFloat(m[1], 64)
	return int64(n)
}

// /metrics reports each admission cap in force with its use, and the sandboxes retiring.
func TestAdmissionMetrics(t *testing.T) {
	b := setup(t, func(c *server.Config) {
		c.NoLedger = true
		c.Admission.Sandboxes = 50
		c.Admission.Checkpoints = 70
		c.Admission.CheckpointBytes = 1 << 30
	})
	rr, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	m := b.scrape(t)
	caps := map[string]int64{"sandboxes": 50, "checkpoints": 70, "checkpoint-bytes": 1 << 30}
	for c, want := range caps {
		if got := gauge(m, "deltagym_admission_cap", `cap="`+c+`"[^}]*`); got != want {
			t.Errorf("deltagym_admission_cap{cap=%q} = %d, want %d", c, got, want)
		}
	}
	for _, c := range []string{"descriptors", "mounts"} { // derived from the machine
		if gauge(m, "deltagym_admission_cap", `cap="`+c+`"[^}]*`) <= 0 || gauge(m, "deltagym_admission_used", `cap="`+c+`"[^}]*`) <= 0 {
			t.Errorf("cap %s and its use are not reported:\n%s", c, m)
		}
	}
	// The two gauges are read apart: while the pool refills, a sandbox made between the reads
	// counts in one only. They agree once it is full.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) { // a watchdog's poll
		live := gauge(m, "deltagym_sandboxes_live", `[^}]*`)
		used := gauge(m, "deltagym_admission_used", `cap="sandboxes"[^}]*`)
		if used >= 1 && used == live {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandboxes used %d, live %d", used, live)
		}
		m = b.scrape(t)
	}
	if got := gauge(m, "deltagym_sandboxes_retiring", `[^}]*`); got < 0 {
		t.Errorf("no deltagym_sandboxes_retiring:\n%s", m)
	}
	_, err = b.connect.Close(t.Context(), connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: rr.Msg.GetSandboxId()}))
	must(t, err)
}
