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
	Unified    bool   `short:"u" help:"print the changes as a patch git apply takes (git's extended headers for modes, new and deleted files) instead of the summary; what a patch cannot carry (directories, owners, symbolic links, whose targets the server does not send) is said on lines starting with # that git apply skips"`
	Path       string `placeholder:"PATH" help:"only changes at this absolute path and below it; process changes, which are under no path, are left out"`
	MaxPaths   int32  `placeholder:"N" help:"the most changed paths to list and count (default: the server's, 10000; at most 100000)"`
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
	if d.Path != "" {
		m.Processes = nil
	}
	if d.Unified {
		_, err = io.WriteString(a.stdout, unifiedText(m))
	} else {
		_, err = io.WriteString(a.stdout, statText(m))
	}
	return err
}

// The text forms of a diff below are the Python SDK's CheckpointDiff.stat() and .unified()
// too (clients/python/deltagym/types.py); the two are kept equal, character for character,
// and testdata/diff_stat.golden is the case both test against.

// statGraph is the widest +/- bar of statText (git fits its own to the terminal).
const statGraph = 50

// isDirChange reports whether p is of a directory on each side it exists on: git tracks no
// directories, so it is listed with a trailing / and not counted as a file.
func isDirChange(p *deltagymv1.PathChange) bool {
	dirOrNone := func(t deltagymv1.FileType) bool {
		return t == deltagymv1.FileType_FILE_TYPE_UNSPECIFIED || t == deltagymv1.FileType_FILE_TYPE_DIRECTORY
	}
	return dirOrNone(p.GetOldType()) && dirOrNone(p.GetNewType())
}

// statText is m as `git diff --stat` prints a diff: a line per path with its lines added and
// removed and a bar of + and - (Bin OLD -> NEW bytes for a binary file; 0 for a change that
// is not of a text file's lines: a mode, a link, a directory), then the summary, then the
// processes that changed. Paths are the sandbox's, absolute; a directory's ends in /. Two
// equal states give "".
func statText(m *deltagymv1.DiffCheckpointsResponse) string {
	var b strings.Builder
	paths := m.GetPaths()
	nameWidth, most, numberWidth := 0, 0, 0
	for _, p := range paths {
		nameWidth = max(nameWidth, len(statName(p)))
		if p.GetBinary() {
			numberWidth = 3 // counts line up with "Bin", as git's do
			continue
		}
		most = max(most, int(p.GetLinesAdded()+p.GetLinesRemoved()))
	}
	numberWidth = max(numberWidth, len(strconv.Itoa(most)))
	var files, ins, del int
	for _, p := range paths {
		if !isDirChange(p) {
			files++
		}
		fmt.Fprintf(&b, " %-*s |", nameWidth, statName(p))
		if p.GetBinary() {
			fmt.Fprintf(&b, " %*s %d -> %d bytes\n", numberWidth, "Bin", p.GetOldSize(), p.GetNewSize())
			continue
		}
		add, rem := int(p.GetLinesAdded()), int(p.GetLinesRemoved())
		ins += add
		del += rem
		fmt.Fprintf(&b, " %*d", numberWidth, add+rem)
		if add+rem > 0 {
			add, rem = statBar(add, rem, most)
			fmt.Fprintf(&b, " %s%s", strings.Repeat("+", add), strings.Repeat("-", rem))
		}
		b.WriteByte('\n')
	}
	if len(paths) > 0 {
		b.WriteString(diffSummary(files, ins, del) + "\n")
	}
	if m.GetTruncated() {
		b.WriteString(truncatedNote(len(paths)) + "\n")
	}
	if m.GetDetailsTruncated() {
		b.WriteString(detailsNote + "\n")
	}
	b.WriteString(processesText(m.GetProcesses(), ""))
	return b.String()
}

func statName(p *deltagymv1.PathChange) string {
	if isDirChange(p) && p.GetPath() != "/" {
		return p.GetPath() + "/"
	}
	return p.GetPath()
}

// statBar scales a path's added and removed lines to the bar as git does: when the most
// changed path has more than statGraph, each side that has lines keeps at least one mark.
func statBar(add, rem, most int) (int, int) {
	if most <= statGraph {
		return add, rem
	}
	linear := func(n int) int {
		if n == 0 {
			return 0
		}
		return 1 + n*(statGraph-1)/most
	}
	total := linear(add + rem)
	if total < 2 && add > 0 && rem > 0 {
		total = 2
	}
	if add < rem {
		add = linear(add)
		return add, total - add
	}
	rem = linear(rem)
	return total - rem, rem
}

// diffSummary is git's summary line: " 2 files changed, 3 insertions(+), 1 deletion(-)", a
// zero count left out unless both are.
func diffSummary(files, ins, del int) string {
	if files == 0 {
		return " 0 files changed"
	}
	s := fmt.Sprintf(" %d %s changed", files, plural(files, "file", "files"))
	if ins > 0 || del == 0 {
		s += fmt.Sprintf(", %d %s(+)", ins, plural(ins, "insertion", "insertions"))
	}
	if del > 0 || ins == 0 {
		s += fmt.Sprintf(", %d %s(-)", del, plural(del, "deletion", "deletions"))
	}
	return s
}

// truncatedNote says that a truncated diff's list, and the totals, are of its first n paths.
func truncatedNote(n int) string {
	return fmt.Sprintf("(more paths changed: the list and the totals cover the first %d only; --max-paths N lists up to N, 100000 at most)", n)
}

// detailsNote says that the server's budgets for a diff's file details ran out
// (details_truncated).
const detailsNote = "(the server's budget for line counts and unified diffs ran out: some text files have neither; --path narrows the diff)"

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// unifiedText is m as a patch that git apply takes (with its default -p1, from the sandbox's
// root): each regular file's change under git's header, `diff --git a/PATH b/PATH`, with its
// extended headers (old mode and new mode, new file mode, deleted file mode) and its unified
// diff, or git's "Binary files ... differ" (which git apply refuses, as it does git's own).
// What a patch cannot carry — a directory, an owner or extended attribute, a symbolic link
// (the diff holds no link target), a special file — and the processes are said on lines
// starting with "# ", which git apply skips. Two equal states give "".
func unifiedText(m *deltagymv1.DiffCheckpointsResponse) string {
	var b strings.Builder
	for _, p := range m.GetPaths() {
		writePatch(&b, p)
	}
	if m.GetTruncated() {
		b.WriteString("# " + truncatedNote(len(m.GetPaths())) + "\n")
	}
	if m.GetDetailsTruncated() {
		b.WriteString("# " + detailsNote + "\n")
	}
	b.WriteString(processesText(m.GetProcesses(), "# "))
	return b.String()
}

// writePatch writes path change p's part of unifiedText.
func writePatch(b *strings.Builder, p *deltagymv1.PathChange) {
	const file, none = deltagymv1.FileType_FILE_TYPE_FILE, deltagymv1.FileType_FILE_TYPE_UNSPECIFIED
	oldT, newT := p.GetOldType(), p.GetNewType()
	if oldT != file && newT != file {
		fmt.Fprintf(b, "# %s: %s\n", statName(p), notPatched(p))
		return
	}
	path := p.GetPath()
	if oldT == file && newT == file && p.GetMetadataOnly() && p.GetOldMode() == p.GetNewMode() {
		fmt.Fprintf(b, "# %s: owner or extended attributes changed\n", path)
		return
	}
	// A path whose type changed to or from a file's is, as in git, a deletion and an addition;
	// the side that is not a file is a note.
	if oldT != file && oldT != none {
		fmt.Fprintf(b, "# %s: deleted %s\n", typedPath(path, oldT), fileTypeWord(oldT))
	}
	fmt.Fprintf(b, "diff --git a%s b%s\n", path, path)
	oldName, newName := "a"+path, "b"+path
	switch {
	case oldT != file:
		oldName = "/dev/null"
		fmt.Fprintf(b, "new file mode %s\n", gitMode(p.GetNewMode()))
	case newT != file:
		newName = "/dev/null"
		fmt.Fprintf(b, "deleted file mode %s\n", gitMode(p.GetOldMode()))
	case p.GetOldMode() != p.GetNewMode():
		fmt.Fprintf(b, "old mode %s\nnew mode %s\n", gitMode(p.GetOldMode()), gitMode(p.GetNewMode()))
	}
	switch {
	case p.GetBinary():
		fmt.Fprintf(b, "Binary files %s and %s differ\n", oldName, newName)
	case p.GetUnifiedDiff() != "":
		b.WriteString(ensureNewline(p.GetUnifiedDiff()))
	}
	if newT != file && newT != none {
		fmt.Fprintf(b, "# %s: new %s\n", typedPath(path, newT), newTypeWords(newT, p.GetNewMode()))
	}
}

// gitMode is a regular file's mode as git writes it: 100 and the permission bits.
func gitMode(perm uint32) string { return fmt.Sprintf("100%03o", perm&0o777) }

// typedPath is path as statText lists a path of type t: a directory's with a trailing /.
func typedPath(path string, t deltagymv1.FileType) string {
	if t == deltagymv1.FileType_FILE_TYPE_DIRECTORY && path != "/" {
		return path + "/"
	}
	return path
}

func fileTypeWord(t deltagymv1.FileType) string {
	switch t {
	case deltagymv1.FileType_FILE_TYPE_FILE:
		return "file"
	case deltagymv1.FileType_FILE_TYPE_DIRECTORY:
		return "directory"
	case deltagymv1.FileType_FILE_TYPE_SYMLINK:
		return "symlink"
	}
	return "special file"
}

// newTypeWords says what a path became: its type and mode, and for a symbolic link that its
// target is not in the diff.
func newTypeWords(t deltagymv1.FileType, mode uint32) string {
	if t == deltagymv1.FileType_FILE_TYPE_SYMLINK {
		return "symlink (its target is not in the diff)"
	}
	return fmt.Sprintf("%s, mode %o", fileTypeWord(t), mode)
}

// notPatched says what changed of a path that is a regular file on neither side.
func notPatched(p *deltagymv1.PathChange) string {
	oldT, newT := p.GetOldType(), p.GetNewType()
	switch p.GetKind() {
	case deltagymv1.ChangeKind_CHANGE_KIND_ADDED:
		return "new " + newTypeWords(newT, p.GetNewMode())
	case deltagymv1.ChangeKind_CHANGE_KIND_REMOVED:
		return "deleted " + fileTypeWord(oldT)
	}
	if oldT != newT {
		return fmt.Sprintf("%s -> %s", fileTypeWord(oldT), newTypeWords(newT, p.GetNewMode()))
	}
	var parts []string
	if p.GetOldMode() != p.GetNewMode() {
		parts = append(parts, fmt.Sprintf("mode %o -> %o", p.GetOldMode(), p.GetNewMode()))
	}
	switch {
	case !p.GetMetadataOnly() && newT == deltagymv1.FileType_FILE_TYPE_SYMLINK:
		parts = append(parts, "target changed (not in the diff)")
	case !p.GetMetadataOnly():
		parts = append(parts, "content changed")
	case len(parts) == 0:
		parts = append(parts, "owner or extended attributes changed")
	}
	return strings.Join(parts, ", ")
}

// processesText lists the processes that came (+), went (-) or changed (~), each line
// starting with prefix.
func processesText(procs []*deltagymv1.ProcessChange, prefix string) string {
	if len(procs) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString(prefix + "processes:\n")
	for _, p := range procs {
		fmt.Fprintf(&b, "%s %s pid %d %s", prefix, changeMark(p.GetKind()), p.GetPid(), shortText(p.GetCommand(), 60))
		if len(p.GetDetails()) > 0 {
			b.WriteString(": " + strings.Join(p.GetDetails(), ", "))
		}
		b.WriteByte('\n')
	}
	return b.String()
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
