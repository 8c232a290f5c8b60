package main

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// printJSON writes m as one line of protojson (lowerCamelCase names, as the
// Connect JSON API uses).
// Every field is written, those at their zero value too (`"durable":
// false`, not a missing key), so a script reads what it asks for.
func printJSON(w io.Writer, m proto.Message) error {
	b, err := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(m)
	if err != nil {
		return fmt.Errorf("encoding %s: %w", m.ProtoReflect().Descriptor().FullName(), err)
	}
	b = append(b, '\n')
	_, err = w.Write(b)
	return err
}

// table writes aligned columns.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)}
	t.row(header...)
	return t
}

func (t *table) row(cells ...string) { fmt.Fprintln(t.tw, strings.Join(cells, "\t")) }

func (t *table) flush() error { return t.tw.Flush() }

// fields writes "name  value" lines, aligned, skipping empty values.
func fields(w io.Writer, kv ...string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] != "" {
			fmt.Fprintf(tw, "%s\t%s\n", kv[i], kv[i+1])
		}
	}
	return tw.Flush()
}

// formatFloat prints a reward or a statistic compactly (1, 0.5, -0.70711).
func formatFloat(f float64) string { return strconv.FormatFloat(f, 'g', 5, 64) }

// formatSeconds prints a duration given in seconds with a unit that fits.
func formatSeconds(s float64) string {
	d := time.Duration(s * float64(time.Second))
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%.3fms", s*1e3)
	case d < time.Second:
		return fmt.Sprintf("%.1fms", s*1e3)
	default:
		return d.Round(time.Millisecond).String()
	}
}

// formatLease prints when a lease expires relative to now.
func formatLease(t *timestamppb.Timestamp, now time.Time) string {
	if t == nil {
		return ""
	}
	left := t.AsTime().Sub(now).Round(time.Second)
	if left <= 0 {
		return "expired"
	}
	return "expires in " + left.String()
}

// formatTime prints a timestamp in UTC to the second.
func formatTime(t *timestamppb.Timestamp) string {
	if t == nil {
		return "-"
	}
	return t.AsTime().UTC().Format("2006-01-02 15:04:05")
}

// formatComponents prints reward components sorted by name: "a=1 b=0.5".
func formatComponents(c map[string]float64) string {
	parts := make([]string, 0, len(c))
	for _, k := range slices.Sorted(maps.Keys(c)) {
		parts = append(parts, k+"="+formatFloat(c[k]))
	}
	return strings.Join(parts, " ")
}

// orDash returns s, or "-" when it is empty, for table cells.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// episodeStatus prints an episode status without its enum prefix.
func episodeStatus(s deltagymv1.EpisodeStatus) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "EPISODE_STATUS_"))
}

// sandboxState prints a sandbox state without its enum prefix.
func sandboxState(s deltagymv1.SandboxState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "SANDBOX_STATE_"))
}

// summarizeAction describes an action in a few words, for trajectory tables.
func summarizeAction(a *deltagymv1.Action) string {
	switch k := a.GetKind().(type) {
	case *deltagymv1.Action_Exec:
		if len(k.Exec.GetArgv()) > 0 {
			return "exec " + shortText(strings.Join(k.Exec.GetArgv(), " "), 48)
		}
		return "exec " + shortText(k.Exec.GetCommand(), 48)
	case *deltagymv1.Action_WriteFile:
		return fmt.Sprintf("write %s (%d bytes)", k.WriteFile.GetPath(), len(k.WriteFile.GetContent()))
	case *deltagymv1.Action_ReadFile:
		return "read " + k.ReadFile.GetPath()
	case *deltagymv1.Action_Submit:
		if k.Submit.Answer != nil {
			return "submit " + shortText(k.Submit.GetAnswer(), 40)
		}
		return "submit"
	}
	return "-"
}

// summarizeObservation describes an observation in a few words.
func summarizeObservation(o *deltagymv1.Observation) string {
	if e := o.GetError(); e != nil {
		return "error " + e.GetErrnoName()
	}
	switch k := o.GetKind().(type) {
	case *deltagymv1.Observation_Exec:
		return execStatus(k.Exec)
	case *deltagymv1.Observation_WriteFile:
		return fmt.Sprintf("size %d", k.WriteFile.GetSize())
	case *deltagymv1.Observation_ReadFile:
		return fmt.Sprintf("%d of %d bytes", len(k.ReadFile.GetContent()), k.ReadFile.GetSize())
	case *deltagymv1.Observation_Submit:
		return shortText(formatComponents(k.Submit.GetComponents()), 40)
	case *deltagymv1.Observation_Reset_:
		return "reset"
	}
	return "-"
}

// execStatus describes how a process ended: "exit 0 in 1.2ms".
func execStatus(e *deltagymv1.ExecResult) string {
	var b strings.Builder
	switch {
	case e.GetTimedOut():
		b.WriteString("timed out")
	case e.GetSignal() != 0:
		fmt.Fprintf(&b, "killed by signal %d", e.GetSignal())
	case e.GetPid() != 0 && e.GetExitCode() == -1:
		fmt.Fprintf(&b, "started in background, pid %d", e.GetPid())
		return b.String() // it runs on: no duration
	default:
		fmt.Fprintf(&b, "exit %d", e.GetExitCode())
	}
	fmt.Fprintf(&b, " in %s", formatSeconds(e.GetDurationSeconds()))
	if e.GetStdoutTruncated() {
		b.WriteString(", stdout truncated")
	}
	if e.GetStderrTruncated() {
		b.WriteString(", stderr truncated")
	}
	return b.String()
}

// shortText cuts s to one line of at most n runes.
func shortText(s string, n int) string {
	s, _, cut := strings.Cut(s, "\n")
	r := []rune(s)
	if len(r) > n {
		return string(r[:n-1]) + "…"
	}
	if cut {
		return s + "…"
	}
	return s
}

// ensureNewline adds a final newline to text that lacks one.
func ensureNewline(s string) string {
	if s == "" || strings.HasSuffix(s, "\n") {
		return s
	}
	return s + "\n"
}

// oneLine makes s one line (" ; " between its lines, runs of spaces as one), for a table cell.
func oneLine(s string) string {
	return strings.Join(strings.Fields(strings.ReplaceAll(s, "\n", " ; ")), " ")
}
