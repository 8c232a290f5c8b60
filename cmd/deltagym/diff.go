package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

type diffCmd struct {
	Base       string `arg:"" help:"the checkpoint compared against"`
	Checkpoint string `arg:"" help:"the checkpoint compared (of the same env)"`
	Unified    bool   `short:"u" help:"print each changed text file's unified diff instead of the summary"`
	Path       string `placeholder:"PATH" help:"only changes at this absolute path and below it"`
	MaxPaths   int32  `placeholder:"N" help:"the most changed paths to list (default: the server's, 10000)"`
}

func (d *diffCmd) Run(ctx context.Context, a *app) error {
	if d.MaxPaths < 0 {
		return usageErrorf("--max-paths %d is negative", d.MaxPaths)
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	// The node of the checkpoint serves the diff; it fetches the base if that is another's.
	env, err := c.owner(d.Checkpoint)
	if err != nil {
		return err
	}
	detail := deltagymv1.DiffDetail_DIFF_DETAIL_LINES
	if d.Unified {
		detail = deltagymv1.DiffDetail_DIFF_DETAIL_UNIFIED
	}
	res, err := env.DiffCheckpoints(ctx, connect.NewRequest(&deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: d.Base, CheckpointId: d.Checkpoint,
		Detail: detail, Path: d.Path, MaxPaths: d.MaxPaths}))
	if err != nil {
		return err
	}
	m := res.Msg
	if a.JSON {
		return printJSON(a.stdout, m)
	}
	if d.Unified {
		err = printUnified(a.stdout, m)
	} else {
		err = printStat(a.stdout, m)
	}
	if err != nil {
		return err
	}
	if m.GetTruncated() {
		if _, err := fmt.Fprintf(a.stdout, "(only the first %d changed paths: --max-paths lists more)\n", len(m.GetPaths())); err != nil {
			return err
		}
	}
	return printProcessChanges(a.stdout, m.GetProcesses())
}

// statWidth is the widest +/- bar of printStat.
const statWidth = 50

// printStat prints m as `git diff --stat` does: a line per path with its lines added and
// removed (Bin OLD -> NEW bytes for a binary file, 0 for a change that is not of a text
// file's lines), and a summary.
func printStat(w io.Writer, m *deltagymv1.DiffCheckpointsResponse) error {
	paths := m.GetPaths()
	width, most := 0, 0
	for _, p := range paths {
		width = max(width, len(p.GetPath()))
		most = max(most, int(p.GetLinesAdded()+p.GetLinesRemoved()))
	}
	countWidth := len(strconv.Itoa(most))
	var ins, del int
	for _, p := range paths {
		ins += int(p.GetLinesAdded())
		del += int(p.GetLinesRemoved())
		var stat string
		switch {
		case p.GetBinary():
			stat = fmt.Sprintf("Bin %d -> %d bytes", p.GetOldSize(), p.GetNewSize())
		default:
			n := int(p.GetLinesAdded() + p.GetLinesRemoved())
			plus, minus := int(p.GetLinesAdded()), int(p.GetLinesRemoved())
			if most > statWidth {
				// Scaled as git scales: each side at least one mark when it has any.
				plus, minus = scaled(plus, most), scaled(minus, most)
			}
			stat = fmt.Sprintf("%*d %s%s", countWidth, n, strings.Repeat("+", plus), strings.Repeat("-", minus))
			stat = strings.TrimRight(stat, " ")
		}
		if _, err := fmt.Fprintf(w, " %-*s | %s\n", width, p.GetPath(), stat); err != nil {
			return err
		}
	}
	_, err := fmt.Fprintln(w, diffSummary(len(paths), ins, del))
	return err
}

func scaled(n, most int) int {
	if n == 0 {
		return 0
	}
	return max(1, n*statWidth/most)
}

// diffSummary is git's summary line: " 2 files changed, 3 insertions(+), 1 deletion(-)".
func diffSummary(files, ins, del int) string {
	s := fmt.Sprintf(" %d %s changed", files, plural(files, "file", "files"))
	if ins > 0 || del == 0 {
		s += fmt.Sprintf(", %d %s(+)", ins, plural(ins, "insertion", "insertions"))
	}
	if del > 0 || ins == 0 {
		s += fmt.Sprintf(", %d %s(-)", del, plural(del, "deletion", "deletions"))
	}
	return s
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// printUnified prints each changed path's unified diff; a change with none (binary, not a
// regular file, metadata only) gets a line saying what changed.
func printUnified(w io.Writer, m *deltagymv1.DiffCheckpointsResponse) error {
	for _, p := range m.GetPaths() {
		var err error
		switch {
		case p.GetUnifiedDiff() != "":
			_, err = io.WriteString(w, p.GetUnifiedDiff())
		case p.GetBinary():
			_, err = fmt.Fprintf(w, "Binary files a%s and b%s differ\n", p.GetPath(), p.GetPath())
		default:
			_, err = fmt.Fprintf(w, "%s %s: %s\n", changeMark(p.GetKind()), p.GetPath(), pathChangeWords(p))
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// pathChangeWords says what changed of a path that has no unified diff.
func pathChangeWords(p *deltagymv1.PathChange) string {
	typ := func(t deltagymv1.FileType) string {
		return strings.ToLower(strings.TrimPrefix(t.String(), "FILE_TYPE_"))
	}
	switch p.GetKind() {
	case deltagymv1.ChangeKind_CHANGE_KIND_ADDED:
		return fmt.Sprintf("new %s, mode %o", typ(p.GetNewType()), p.GetNewMode())
	case deltagymv1.ChangeKind_CHANGE_KIND_REMOVED:
		return fmt.Sprintf("deleted %s", typ(p.GetOldType()))
	}
	var parts []string
	if p.GetOldType() != p.GetNewType() {
		parts = append(parts, fmt.Sprintf("%s -> %s", typ(p.GetOldType()), typ(p.GetNewType())))
	}
	if p.GetOldMode() != p.GetNewMode() {
		parts = append(parts, fmt.Sprintf("mode %o -> %o", p.GetOldMode(), p.GetNewMode()))
	}
	if p.GetMetadataOnly() && len(parts) == 0 {
		parts = append(parts, "owner or extended attributes")
	}
	if len(parts) == 0 {
		parts = append(parts, fmt.Sprintf("%d -> %d bytes", p.GetOldSize(), p.GetNewSize()))
	}
	return strings.Join(parts, ", ")
}

func changeMark(k deltagymv1.ChangeKind) string {
	switch k {
	case deltagymv1.ChangeKind_CHANGE_KIND_ADDED:
		return "+"
	case deltagymv1.ChangeKind_CHANGE_KIND_REMOVED:
		return "-"
	}
	return "~"
}

// printProcessChanges lists the processes that came (+), went (-) or changed (~).
func printProcessChanges(w io.Writer, procs []*deltagymv1.ProcessChange) error {
	if len(procs) == 0 {
		return nil
	}
	if _, err := fmt.Fprintln(w, "processes:"); err != nil {
		return err
	}
	for _, p := range procs {
		line := fmt.Sprintf(" %s pid %d %s", changeMark(p.GetKind()), p.GetPid(), shortText(p.GetCommand(), 60))
		if len(p.GetDetails()) > 0 {
			line += ": " + strings.Join(p.GetDetails(), ", ")
		}
		if _, err := fmt.Fprintln(w, line); err != nil {
			return err
		}
	}
	return nil
}
