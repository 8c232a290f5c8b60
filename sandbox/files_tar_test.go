package sandbox_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// entry is one entry of a test archive.
type entry struct {
	name string
	typ  byte
	body string
	link string
	mode int64
}

func tarOf(t testing.TB, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		mode := e.mode
		if mode == 0 {
			mode = 0o644
		}
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Linkname: e.link, Mode: mode, Size: int64(len(e.body)), Format: tar.FormatPAX}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(tw, e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gzipOf(t testing.TB, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func file(name, body string) entry { return entry{name: name, typ: tar.TypeReg, body: body} }

// Hostile archives are refused whole (ErrInvalid, not a FileError) and write nothing, not
// even the directory they were to go to.
func TestUploadRefusesHostileArchives(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	many := make([]entry, sandbox.MaxUploadEntries+1)
	for i := range many {
		many[i] = entry{name: "d/" + strconv.Itoa(i), typ: tar.TypeReg}
	}
	for _, tc := range []struct {
		name    string
		archive []byte
		says    string
	}{
		{"dot-dot", tarOf(t, file("ok", "x"), file("../x", "escaped")), `".."`},
		{"dot-dot inside", tarOf(t, file("a/../../x", "escaped")), `".."`},
		{"absolute", tarOf(t, file("/etc/x", "escaped")), `absolute`},
		{"hard link to /etc/passwd", tarOf(t, entry{name: "pw", typ: tar.TypeLink, link: "/etc/passwd"}), `absolute`},
		{"hard link up", tarOf(t, entry{name: "pw", typ: tar.TypeLink, link: "../../etc/passwd"}), `".."`},
		{"hard link to a file of the sandbox", tarOf(t, entry{name: "pw", typ: tar.TypeLink, link: "bin/busybox"}), `earlier file`},
		{"hard link to a later entry", tarOf(t, entry{name: "l", typ: tar.TypeLink, link: "f"}, file("f", "x")), `earlier file`},
		{"file through a symlink", tarOf(t, entry{name: "l", typ: tar.TypeSymlink, link: "/etc"}, file("l/x", "through")), `makes a symlink`},
		{"file through a relative symlink", tarOf(t, entry{name: "l", typ: tar.TypeSymlink, link: "."}, file("l/l/x", "through")), `makes a symlink`},
		{"symlink over a parent", tarOf(t, file("a/f", "x"), entry{name: "a", typ: tar.TypeSymlink, link: "/"}), `twice`},
		{"device", tarOf(t, entry{name: "null", typ: tar.TypeChar}), `device or FIFO`},
		{"block device", tarOf(t, entry{name: "sda", typ: tar.TypeBlock}), `device or FIFO`},
		{"fifo", tarOf(t, entry{name: "p", typ: tar.TypeFifo}), `device or FIFO`},
		{"not a tar", []byte("hello, this is not a tar archive at all, but it is long enough to be read as a header block? no." + strings.Repeat("x", 600)), `not a valid tar`},
		{"bad gzip", []byte{0x1f, 0x8b, 0, 0, 0}, `not valid gzip`},
		{"too many entries", gzipOf(t, tarOf(t, many...)), `more than 100000 entries`},
		{"gzip bomb", gzipBomb(t, 20, 64), `file contents of more than`},
		{"metadata bomb", metaBomb(t, 1400), `unpacks to more than`},
		{"over the archive cap", make([]byte, sandbox.MaxArchiveBytes+1), `at most`},
		{"a component past NAME_MAX", tarOf(t, file("d/"+strings.Repeat("n", 256), "x")), `NAME_MAX`},
		{"a hard link's component past NAME_MAX", tarOf(t, file("f", "x"), entry{name: "l", typ: tar.TypeLink, link: strings.Repeat("n", 256)}), `NAME_MAX`},
		{"names past their cap", namesBomb(t, 5000), `names take more than 16 MiB`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := s.Upload(ctx, "/up/"+strings.ReplaceAll(tc.name, " ", "-"), tc.archive)
			if !errors.Is(err, sandbox.ErrInvalid) || fileErrno(err) != 0 || st != (sandbox.UploadStats{}) || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("Upload: %+v, %v; want ErrInvalid saying %q, and nothing written", st, err, tc.says)
			}
		})
	}
	if _, ok, _ := s.Stat(ctx, "/up"); ok {
		t.Errorf("a refused upload made its directory: %s", sh(t, s, "find /up"))
	}
	if out := sh(t, s, "ls /x /etc/x /pw 2>&1; true"); strings.Count(out, "No such file") != 3 {
		t.Errorf("a refused upload wrote outside: %q", out)
	}
}

// gzipBomb is a gzip stream (members concatenated, which gzip readers read as one) of an
// archive of n files of mib MiB of zeros each: a few hundred KiB that unpack to n*mib MiB.
func gzipBomb(t *testing.T, n, mib int) []byte {
	t.Helper()
	zeros := gzipOf(t, make([]byte, 1<<20))
	var out bytes.Buffer
	for i := range n {
		var hdr bytes.Buffer
		tw := tar.NewWriter(&hdr)
		if err := tw.WriteHeader(&tar.Header{Name: "z" + strconv.Itoa(i), Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(mib) << 20}); err != nil {
			t.Fatal(err)
		}
		tw.Flush()
		out.Write(gzipOf(t, hdr.Bytes()))
		for range mib {
			out.Write(zeros)
		}
	}
	return out.Bytes()
}

// metaBomb is a gzip stream of n entries of the same directory (which an archive may repeat),
// each with a PAX record of 1 MiB: a few MiB that unpack to n MiB of headers.
func metaBomb(t testing.TB, n int) []byte {
	t.Helper()
	var hdr bytes.Buffer
	tw := tar.NewWriter(&hdr)
	if err := tw.WriteHeader(&tar.Header{Name: "m/", Typeflag: tar.TypeDir, Mode: 0o755, Format: tar.FormatPAX,
		PAXRecords: map[string]string{"comment": strings.Repeat("a", 1<<20-64)}}); err != nil {
		t.Fatal(err)
	}
	tw.Flush()
	member := gzipOf(t, hdr.Bytes())
	return bytes.Repeat(member, n)
}

// gzipHeaders is a gzip stream of a tar archive of the n headers hdr gives, streamed: the
// archive, however large, is never held whole.
func gzipHeaders(t testing.TB, n int, hdr func(i int) *tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for i := range n {
		if err := tw.WriteHeader(hdr(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(tw.Close(), zw.Close()); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// namesBomb is a gzip stream of n files of distinct names of some 4,000 bytes each (15
// components of 255 bytes and a number), all in the same directories: a few KiB per thousand
// entries that the check, were it to keep the names, would keep 4 KB of each.
func namesBomb(t testing.TB, n int) []byte {
	dir := strings.Repeat(strings.Repeat("d", 255)+"/", 15)
	return gzipHeaders(t, n, func(i int) *tar.Header {
		return &tar.Header{Name: dir + strconv.Itoa(i), Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatPAX}
	})
}

// commentBomb is a gzip stream of n files of distinct names, each with a PAX record of
// 1 MiB, which the tar reader gives in the same string as the name (a PAX record too): a
// valid archive whose check keeps the names, not the records.
func commentBomb(t testing.TB, n int) []byte {
	comment := strings.Repeat("a", 1<<20-256)
	long := strings.Repeat("c", 120) // past a ustar name: a PAX record
	return gzipHeaders(t, n, func(i int) *tar.Header {
		return &tar.Header{Name: long + strconv.Itoa(i), Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatPAX,
			PAXRecords: map[string]string{"comment": comment}}
	})
}

// repeatedDirBomb is n directories, each named twice: plainly, then in a PAX header with a
// comment of about 1 MiB, as the name of an entry the check has seen already.
func repeatedDirBomb(t testing.TB, n int) []byte {
	comment := strings.Repeat("a", 1<<20-256)
	long := strings.Repeat("c", 120)
	return gzipHeaders(t, 2*n, func(i int) *tar.Header {
		h := &tar.Header{Name: long + strconv.Itoa(i/2) + "/", Typeflag: tar.TypeDir, Mode: 0o755, Format: tar.FormatPAX}
		if i%2 == 1 {
			h.PAXRecords = map[string]string{"comment": comment}
		}
		return h
	})
}

// Checking a bomb reads it as a stream: the heap it holds at any time (sampled while it runs)
// is a small part of what it unpacks to, and of what its names take.
func TestCheckArchiveBombMemory(t *testing.T) {
	heap := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	for name, tc := range map[string]struct {
		bomb []byte
		says string // "" for an archive the check takes
	}{
		"contents": {gzipBomb(t, 20, 64), "more than"},
		"metadata": {metaBomb(t, 1400), "more than"},
		"names":    {namesBomb(t, 40000), "names take more than"},
		"comments": {commentBomb(t, 200), ""},
		"repeated": {repeatedDirBomb(t, 300), ""},
	} {
		runtime.GC()
		metrics.Read(heap)
		base := heap[0].Value.Uint64()
		done := make(chan struct{})
		peak := make(chan uint64)
		go func() {
			var most uint64
			tick := time.NewTicker(2 * time.Millisecond)
			defer tick.Stop()
			for {
				s := []metrics.Sample{{Name: heap[0].Name}}
				metrics.Read(s)
				most = max(most, s[0].Value.Uint64())
				select {
				case <-done:
					peak <- most
					return
				case <-tick.C:
				}
			}
		}()
		err := sandbox.CheckArchive(t.Context(), tc.bomb)
		close(done)
		most := <-peak
		if tc.says == "" && err != nil || tc.says != "" && (!errors.Is(err, sandbox.ErrInvalid) || !strings.Contains(err.Error(), tc.says)) {
			t.Errorf("%s bomb: %v, want ErrInvalid saying %q (none when empty)", name, err, tc.says)
		}
		if most > base+128<<20 {
			t.Errorf("%s bomb: the heap grew from %d MiB to %d MiB while it was checked", name, base>>20, most>>20)
		}
	}
}

func TestUpload(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{UID: 1000, GID: 1000})
	ctx := t.Context()
	archive := tarOf(t,
		entry{name: "./", typ: tar.TypeDir, mode: 0o755},
		entry{name: "ro/", typ: tar.TypeDir, mode: 0o555},
		entry{name: "ro/f", typ: tar.TypeReg, body: "in a read-only dir", mode: 0o644},
		entry{name: "suid", typ: tar.TypeReg, body: "#!/bin/sh\n", mode: 0o6755},
		entry{name: "sticky/", typ: tar.TypeDir, mode: 0o1777},
		entry{name: "implicit/parents/f", typ: tar.TypeReg, body: "x"},
		entry{name: "abs", typ: tar.TypeSymlink, link: "/etc/passwd"},
		entry{name: "hard", typ: tar.TypeLink, link: "suid"},
	)
	st, err := s.Upload(ctx, "/tmp/new/dir", gzipOf(t, archive))
	if err != nil {
		t.Fatal(err)
	}
	if st.Files != 7 || st.Bytes != int64(len("in a read-only dir")+len("#!/bin/sh\n")+1) {
		t.Errorf("stats %+v", st)
	}
	out := sh(t, s, "cd /tmp/new/dir && stat -c '%n %a %u %h' ro ro/f suid sticky implicit implicit/parents/f hard && readlink abs")
	want := "ro 555 1000 2\nro/f 644 1000 1\nsuid 755 1000 2\nsticky 777 1000 2\nimplicit 755 1000 3\nimplicit/parents/f 644 1000 1\nhard 755 1000 2\n/etc/passwd\n"
	if out != want {
		t.Errorf("unpacked:\n%s\nwant:\n%s", out, want)
	}

	// An existing symlink of the sandbox on the way is refused, not written through.
	sh(t, s, "mkdir -p /tmp/t && ln -s /tmp/elsewhere /tmp/t/l && mkdir /tmp/elsewhere")
	_, err = s.Upload(ctx, "/tmp/t", tarOf(t, file("l/x", "through")))
	if fileErrno(err) != unix.ELOOP {
		t.Errorf("upload through the sandbox's symlink: %v, want ELOOP", err)
	}
	if out := sh(t, s, "ls /tmp/elsewhere"); out != "" {
		t.Errorf("written through the symlink: %q", out)
	}
	// A file replaces a file (and a symlink, itself); a directory stays, and a file over it is EISDIR.
	sh(t, s, "mkdir -p /tmp/r/d && echo old > /tmp/r/f && ln -s /tmp/elsewhere /tmp/r/s")
	if _, err := s.Upload(ctx, "/tmp/r", tarOf(t, file("f", "new"), file("s", "file"))); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, s, "cat /tmp/r/f /tmp/r/s; ls /tmp/elsewhere"); out != "newfile" {
		t.Errorf("replaced: %q", out)
	}
	if _, err := s.Upload(ctx, "/tmp/r", tarOf(t, file("d", "x"))); fileErrno(err) != unix.EISDIR {
		t.Errorf("a file over a directory: %v, want EISDIR", err)
	}
	// A directory already there keeps its mode; a symlink where the archive has a directory is EEXIST.
	if _, err := s.Upload(ctx, "/", tarOf(t, entry{name: "tmp/", typ: tar.TypeDir, mode: 0o700}, file("tmp/up", "x"))); err != nil {
		t.Errorf("upload into /: %v", err)
	}
	if out := sh(t, s, "stat -c %a /tmp"); out != "1777\n" {
		t.Errorf("/tmp's mode after an upload with a tmp/ entry: %s", out)
	}
	if _, err := s.Upload(ctx, "/tmp/t", tarOf(t, entry{name: "l/", typ: tar.TypeDir})); fileErrno(err) != unix.EEXIST {
		t.Errorf("a directory over a symlink: %v, want EEXIST", err)
	}
	// The user's permissions hold.
	if _, err := s.Upload(ctx, "/root", tarOf(t, file("x", "x"))); fileErrno(err) != unix.EACCES {
		t.Errorf("upload into a directory the user may not write: %v, want EACCES", err)
	}
}

// Download packs a tree with hard links, symlinks and empty directories, leaving a FIFO out,
// and Upload brings it back the same (but for setuid, setgid and sticky, which it drops).
func TestDownloadUploadRoundTrip(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /src/empty /src/sub/deeper && echo one > /src/a && ln /src/a /src/sub/hard && ln -s ../a /src/sub/rel && "+
		"ln -s /etc /src/abs && printf 'x%.0s' $(seq 1000) > /src/sub/deeper/big && chmod 700 /src/sub && chmod 750 /src/empty && mkfifo /src/fifo && "+
		"touch -d @1700000000 /src/a /src/empty")
	archive, files, err := s.Download(ctx, "/src", 0)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	tr := tar.NewReader(bytes.NewReader(archive))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		n := h.Name
		switch h.Typeflag {
		case tar.TypeLink:
			n += " => " + h.Linkname
		case tar.TypeSymlink:
			n += " -> " + h.Linkname
		}
		names = append(names, n)
	}
	want := "src/ src/a src/abs -> /etc src/empty/ src/sub/ src/sub/deeper/ src/sub/deeper/big src/sub/hard => src/a src/sub/rel -> ../a"
	if got := strings.Join(names, " "); got != want || files != int64(len(names)) {
		t.Fatalf("archive (%d files): %s\nwant: %s", files, got, want)
	}
	if _, err := s.Upload(ctx, "/dst", archive); err != nil {
		t.Fatal(err)
	}
	desc := "find . | sort | while read p; do stat -c '%n %F %a %s %Y %h' \"$p\"; done; readlink sub/rel abs; [ $(stat -c %i a) = $(stat -c %i sub/hard) ] && echo same inode"
	src := sh(t, s, "cd /src && rm fifo && "+desc)
	if dst := sh(t, s, "cd /dst/src && "+desc); dst != src {
		t.Errorf("round trip:\n%s\nwant:\n%s", dst, src)
	}
	if _, _, err := s.Download(ctx, "/src", 4096); fileErrno(err) != unix.EFBIG {
		t.Errorf("Download past max_bytes: %v, want EFBIG", err)
	}
	if b, n, err := s.Download(ctx, "/src/a", 0); err != nil || n != 1 || !bytes.Contains(b, []byte("one\n")) {
		t.Errorf("Download of a file: %d files, %v", n, err)
	}
	for _, p := range []string{"/", "/src/..", "/missing"} {
		if _, _, err := s.Download(ctx, p, 0); err == nil {
			t.Errorf("Download %s: no error", p)
		}
	}
}

// A name swapped for a symlink to a directory of the host between a walk's check of it and
// its open (SetFileRaceHook: where a racing process of the sandbox would) is not followed, by
// Remove or by Download.
func TestTreeWalksRaceSymlinkSwap(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	canary := filepath.Join(b.dir, "canary")
	if err := os.MkdirAll(filepath.Join(canary, "keep"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(canary, "keep", "secret"), []byte("host-secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	swapped := 0
	defer sandbox.SetFileRaceHook(func(dir int, name string) {
		if name == "d" {
			_ = unix.Symlinkat(canary, dir, "s")
			if err := unix.Renameat2(dir, "d", dir, "s", unix.RENAME_EXCHANGE); err != nil {
				t.Errorf("swapping: %v", err)
			}
			swapped++
		}
	})()
	for _, op := range []string{"remove", "download", "download inner"} {
		sh(t, s, "rm -rf /w; mkdir -p /w/d/keep && touch /w/d/keep/f")
		var err error
		var archive []byte
		switch op {
		case "remove":
			_, err = s.Remove(ctx, "/w", true)
		case "download":
			archive, _, err = s.Download(ctx, "/w/d", 0)
		case "download inner":
			archive, _, err = s.Download(ctx, "/w", 0)
		}
		if err != nil && fileErrno(err) == 0 {
			t.Errorf("%s: %v, want success or a FileError", op, err)
		}
		if bytes.Contains(archive, []byte("host-secret")) {
			t.Errorf("%s: the archive holds the host's file", op)
		}
		if _, err := os.Stat(filepath.Join(canary, "keep", "secret")); err != nil {
			t.Fatalf("%s: the host's file: %v", op, err)
		}
	}
	if swapped != 3 {
		t.Errorf("swapped %d times, want 3", swapped)
	}
}

// A process of the sandbox that keeps swapping the directories an upload writes into for
// symlinks (to the sandbox's root, and to a directory of the host) makes the upload fail
// (ELOOP) or write into the directory: nothing is written through a symlink.
func TestUploadRacesSymlinkSwap(t *testing.T) {
	b := setup(t, filesOnly)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	canary := filepath.Join(b.dir, "canary")
	if err := os.MkdirAll(canary, 0o777); err != nil {
		t.Fatal(err)
	}
	const pairs = 16
	fileswap(t, s, "/up", pairs, "/", canary)
	var entries []entry
	for k := range pairs {
		for _, n := range []string{"d", "s"} {
			entries = append(entries, file(n+strconv.Itoa(k)+"/escaped/f", "x"), entry{name: n + strconv.Itoa(k) + "/escapedir/", typ: tar.TypeDir})
		}
	}
	archive := tarOf(t, entries...)
	wrote, refused := 0, 0
	for range 200 {
		st, err := s.Upload(ctx, "/up", archive)
		if err != nil && fileErrno(err) == 0 {
			t.Fatalf("Upload: %v, want success or a FileError", err)
		}
		if err != nil {
			refused++
		}
		wrote += int(st.Files)
	}
	t.Logf("%d entries written; %d uploads refused", wrote, refused)
	if wrote == 0 || refused == 0 {
		t.Fatal("no race was run")
	}
	if out := sh(t, s, "ls -d /escaped /escapedir 2>&1; true"); strings.Count(out, "No such file") != 2 {
		t.Errorf("written through a symlink to the sandbox's root: %q", out)
	}
	if left, err := os.ReadDir(canary); err != nil || len(left) != 0 {
		t.Errorf("written through a symlink to the host: %v, %v", left, err)
	}
}

// Whatever the bytes, CheckArchive accepts them or refuses them with ErrInvalid; it never
// panics or fails otherwise.
func FuzzCheckArchive(f *testing.F) {
	ok := tarOf(f, entry{name: "d/", typ: tar.TypeDir}, file("d/f", "x"), entry{name: "d/h", typ: tar.TypeLink, link: "d/f"},
		entry{name: "d/s", typ: tar.TypeSymlink, link: "/etc"})
	for _, seed := range [][]byte{ok, gzipOf(f, ok), tarOf(f, file("../x", "x")), {}, {0x1f, 0x8b}} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if err := sandbox.CheckArchive(t.Context(), b); err != nil && !errors.Is(err, sandbox.ErrInvalid) {
			t.Fatalf("CheckArchive: %v, want nil or ErrInvalid", err)
		}
	})
}

// An archive of as many entries as an upload takes (files in directories, after git
// archive's PAX global header, which is no entry) is written whole.
func TestUploadMostEntries(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(tw.WriteHeader(&tar.Header{Typeflag: tar.TypeXGlobalHeader, Name: "pax_global_header", PAXRecords: map[string]string{"comment": "0123abcd"}}))
	const dirs = 100
	for d := range dirs {
		must(tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "d" + strconv.Itoa(d) + "/", Mode: 0o755}))
		for f := range sandbox.MaxUploadEntries/dirs - 1 {
			must(tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "d" + strconv.Itoa(d) + "/" + strconv.Itoa(f), Mode: 0o644}))
		}
	}
	must(tw.Close())
	st, err := s.Upload(t.Context(), "/many", gzipOf(t, buf.Bytes()))
	if err != nil || st.Files != sandbox.MaxUploadEntries {
		t.Fatalf("Upload: %+v, %v; want %d files", st, err, sandbox.MaxUploadEntries)
	}
	if out := sh(t, s, "find /many -type f | wc -l"); strings.TrimSpace(out) != strconv.Itoa(sandbox.MaxUploadEntries-dirs) {
		t.Errorf("%s files in the sandbox", out)
	}
}
