package server_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server/episode"
)

// mtime is the modification time of filesTar's entries.
const mtime = 1700000000

// filesTar is a gzip-compressed archive of a directory d holding a file of random bytes
// (incompressible, past the ledger's cap on an action's bulk), a small file, a symlink and a
// hard link; and a symlink to /tmp.
func filesTar(t *testing.T) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	big := make([]byte, 2*episode.ActionBytesCap)
	rand.Read(big)
	for _, e := range []struct {
		h    tar.Header
		body []byte
	}{
		{tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755}, nil},
		{tar.Header{Name: "d/big", Typeflag: tar.TypeReg, Mode: 0o600}, big},
		{tar.Header{Name: "d/small", Typeflag: tar.TypeReg, Mode: 0o644}, []byte("small\n")},
		{tar.Header{Name: "d/link", Typeflag: tar.TypeSymlink, Linkname: "small"}, nil},
		{tar.Header{Name: "d/tmp", Typeflag: tar.TypeSymlink, Linkname: "/tmp"}, nil},
		{tar.Header{Name: "d/hard", Typeflag: tar.TypeLink, Linkname: "d/small"}, nil},
	} {
		e.h.Size, e.h.ModTime = int64(len(e.body)), time.Unix(mtime, 0)
		must(t, tw.WriteHeader(&e.h))
		_, err := tw.Write(e.body)
		must(t, err)
	}
	must(t, tw.Close())
	must(t, zw.Close())
	return buf.Bytes()
}

func fileAction(a proto.Message) *deltagymv1.Action {
	switch x := a.(type) {
	case *deltagymv1.ListDirAction:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_ListDir{ListDir: x}}
	case *deltagymv1.StatAction:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Stat{Stat: x}}
	case *deltagymv1.RemoveAction:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Remove{Remove: x}}
	case *deltagymv1.MakeDirAction:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_MakeDir{MakeDir: x}}
	case *deltagymv1.UploadAction:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Upload{Upload: x}}
	case *deltagymv1.DownloadAction:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Download{Download: x}}
	}
	panic("not a file action")
}

// tarNames lists the entries of a tar archive.
func tarNames(t *testing.T, b []byte) []string {
	t.Helper()
	var names []string
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return names
		}
		must(t, err)
		names = append(names, h.Name)
	}
}

// The file actions through the real server over Connect and gRPC: each maps to its result,
// the sandbox's state refusing one is the observation's error (a step), a request wrong
// whatever the sandbox holds is InvalidArgument (no step), and the ledger records each step
// with an upload's archive and a download's cut to the ledger's caps.
func TestFileActionsOverWire(t *testing.T) {
	b := setup(t, nil)
	archive := filesTar(t)
	// An entry below the symlink d/tmp the first archive left in the sandbox.
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	must(t, tw.WriteHeader(&tar.Header{Name: "d/tmp/x", Typeflag: tar.TypeReg, Mode: 0o644}))
	must(t, tw.Close())
	below := buf.Bytes()
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c := cl.c
			rr, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
			defer c.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
			step := func(a proto.Message) *deltagymv1.Observation {
				t.Helper()
				st, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: fileAction(a)})
				must(t, err)
				return st.GetObservation()
			}

			if o := step(&deltagymv1.MakeDirAction{Path: "/w/up", Parents: true, Mode: 0o750}); !o.GetMakeDir().GetCreated() {
				t.Fatalf("make_dir: %v", o)
			}
			up := step(&deltagymv1.UploadAction{Path: "/w/up", Tar: archive}).GetUpload()
			if up.GetFiles() != 6 || up.GetBytes() != 2*episode.ActionBytesCap+6 {
				t.Errorf("upload: %v", up)
			}
			ls := step(&deltagymv1.ListDirAction{Path: "/w/up", Depth: 2}).GetListDir()
			var got []string
			for _, e := range ls.GetEntries() {
				got = append(got, e.GetPath()+":"+e.GetType().String()+":"+e.GetSymlinkTarget())
			}
			if want := "d:FILE_TYPE_DIRECTORY: d/big:FILE_TYPE_FILE: d/hard:FILE_TYPE_FILE: d/link:FILE_TYPE_SYMLINK:small d/small:FILE_TYPE_FILE: d/tmp:FILE_TYPE_SYMLINK:/tmp"; strings.Join(got, " ") != want || ls.GetTruncated() {
				t.Errorf("list_dir: %s, truncated %v; want %s", strings.Join(got, " "), ls.GetTruncated(), want)
			}
			if st := step(&deltagymv1.StatAction{Path: "/w/up/d/small"}).GetStat(); !st.GetExists() || st.GetInfo().GetSize() != 6 ||
				st.GetInfo().GetMode() != 0o644 || st.GetInfo().GetModifyTimeSeconds() != mtime {
				t.Errorf("stat: %v", st)
			}
			if st := step(&deltagymv1.StatAction{Path: "/w/nope"}); st.GetStat() == nil || st.GetStat().GetExists() {
				t.Errorf("stat of a missing path: %v", st)
			}
			dl := step(&deltagymv1.DownloadAction{Path: "/w/up/d"}).GetDownload()
			if names := strings.Join(tarNames(t, dl.GetTar()), " "); names != "d/ d/big d/hard d/link d/small d/tmp" || dl.GetFiles() != 6 {
				t.Errorf("download: %s (%d files)", names, dl.GetFiles())
			}
			full, _ := proto.MarshalOptions{Deterministic: true}.Marshal(&deltagymv1.Observation{Kind: &deltagymv1.Observation_Download{Download: dl}})
			// The sandbox's state: agent errors, as steps.
			for _, tc := range []struct {
				a     proto.Message
				errno unix.Errno
			}{
				{&deltagymv1.RemoveAction{Path: "/w/up"}, unix.ENOTEMPTY},
				{&deltagymv1.DownloadAction{Path: "/w/up", MaxBytes: 4096}, unix.EFBIG},
				{&deltagymv1.MakeDirAction{Path: "/w/up"}, unix.EEXIST},
				{&deltagymv1.ListDirAction{Path: "/w/up/d/small"}, unix.ENOTDIR},
				{&deltagymv1.UploadAction{Path: "/w/up/d/small", Tar: archive}, unix.ENOTDIR},
				{&deltagymv1.UploadAction{Path: "/w/up", Tar: below}, unix.ELOOP},
			} {
				if e := step(tc.a).GetError(); e.GetErrno() != int32(tc.errno) || e.GetErrnoName() != unix.ErrnoName(tc.errno) || e.GetMessage() == "" {
					t.Errorf("%T: observation error %v, want %s", tc.a, e, unix.ErrnoName(tc.errno))
				}
			}
			if o := step(&deltagymv1.RemoveAction{Path: "/w/up", Recursive: true}); o.GetRemove().GetRemoved() != 7 {
				t.Errorf("remove: %v", o)
			}
			// Wrong whatever the sandbox holds: InvalidArgument, and no step.
			before, _ := nextStep(t, c, sb)
			for _, a := range []proto.Message{
				&deltagymv1.UploadAction{Path: "/w", Tar: []byte("not a tar archive")},
				&deltagymv1.ListDirAction{Path: "/w", MaxEntries: 10001},
				&deltagymv1.ListDirAction{Path: "/w", Depth: -1},
				&deltagymv1.MakeDirAction{Path: "/w/x", Mode: 0o4755},
				&deltagymv1.DownloadAction{Path: "/w", MaxBytes: 64<<20 + 1},
				&deltagymv1.RemoveAction{Path: "/", Recursive: true},
				&deltagymv1.StatAction{},
			} {
				_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: fileAction(a)})
				if codeOf(err) != connect.CodeInvalidArgument {
					t.Errorf("%T %v: %v, want InvalidArgument", a, a.(interface{ GetPath() string }).GetPath(), err)
				}
			}
			// A hostile archive with a restore: refused before the restore, which does not happen.
			var hostile bytes.Buffer
			tw := tar.NewWriter(&hostile)
			must(t, tw.WriteHeader(&tar.Header{Name: "../escape", Typeflag: tar.TypeReg, Mode: 0o644}))
			must(t, tw.Close())
			_, err = c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, RestoreCheckpointId: rr.GetCheckpointId(),
				Action: fileAction(&deltagymv1.UploadAction{Path: "/w", Tar: hostile.Bytes()})})
			if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), `".."`) {
				t.Errorf("upload of ../escape with a restore: %v, want InvalidArgument naming the \"..\"", err)
			}
			g, err := c.GetSandbox(t.Context(), &deltagymv1.GetSandboxRequest{SandboxId: sb})
			must(t, err)
			if after, ok := nextStep(t, c, sb); after != before || !ok || g.GetSandbox().GetEpisodeId() != ep {
				t.Errorf("refused requests took steps or restored: step %d then %d, episode %s then %s", before, after, ep, g.GetSandbox().GetEpisodeId())
			}

			tr, err := c.GetTrajectory(t.Context(), &deltagymv1.GetTrajectoryRequest{EpisodeId: ep})
			must(t, err)
			kinds := map[string]int{}
			for _, s := range tr.GetSteps() {
				a := s.GetAction()
				switch k := a.GetKind().(type) {
				case *deltagymv1.Action_Upload:
					// The small archive is kept whole; the large one's first ActionBytesCap bytes, with its size and hash.
					sum := sha256.Sum256(archive)
					kept := k.Upload.GetTar()
					small := bytes.Equal(kept, below) && s.GetActionBulkSizeBytes() == 0
					if !small && (!bytes.Equal(kept, archive[:episode.ActionBytesCap]) ||
						s.GetActionBulkSizeBytes() != int64(len(archive)) || s.GetActionBulkSha256() != hex.EncodeToString(sum[:])) {
						t.Errorf("the upload's archive in the ledger: %d bytes kept, size %d", len(kept), s.GetActionBulkSizeBytes())
					}
				case *deltagymv1.Action_Download:
					if k.Download.GetMaxBytes() == 0 {
						sum := sha256.Sum256(full)
						if n := len(s.GetObservation().GetDownload().GetTar()); n == 0 || n > episode.ObservationBulkCap ||
							s.GetObservationSizeBytes() != int64(len(full)) || s.GetObservationSha256() != hex.EncodeToString(sum[:]) {
							t.Errorf("the download in the ledger: %d bytes of archive, size %d of %d", n, s.GetObservationSizeBytes(), len(full))
						}
					}
				}
				kinds[strings.TrimPrefix(fmt.Sprintf("%T", a.GetKind()), "*deltagymv1.Action_")]++
			}
			want := map[string]int{"MakeDir": 2, "Upload": 3, "ListDir": 2, "Stat": 2, "Download": 2, "Remove": 2}
			for k, n := range want {
				if kinds[k] != n {
					t.Errorf("the trajectory has %d %s steps, want %d (%v)", kinds[k], k, n, kinds)
				}
			}
		})
	}
}
