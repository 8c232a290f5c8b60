package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/image/imagetest"
)

// importWithin runs Import and fails the test if it has not returned within a minute: the
// imports below must fail fast, never hang.
func importWithin(t *testing.T, src, dir string, opts ...Option) (*Imported, error) {
	t.Helper()
	type result struct {
		imp *Imported
		err error
	}
	done := make(chan result, 1)
	go func() {
		imp, err := Import(t.Context(), src, dir, opts...)
		done <- result{imp, err}
	}()
	select {
	case r := <-done:
		return r.imp, r.err
	case <-time.After(time.Minute):
		t.Fatalf("Import of %s still runs after a minute", src)
		return nil, nil
	}
}

// checkLeftEmpty checks that a failed import left nothing in its directory.
func checkLeftEmpty(t *testing.T, dir string) {
	t.Helper()
	if names := entries(t, dir); len(names) > 0 {
		t.Fatalf("a failed import left %v", names)
	}
}

// An import over its cap fails with ErrTooLarge and leaves nothing, in every format: by a file's
// size, by many entries, and by bytes a layer blob unpacks without writing them (data after the
// tar's end).
func TestImportCap(t *testing.T) {
	requireRoot(t)
	const limit = 1 << 20
	big := []imagetest.Layer{{Entries: []imagetest.Entry{imagetest.File("big", string(make([]byte, 2*limit)), 0o644)}}}
	var many []imagetest.Entry
	for i := range limit/entryCost + 10 {
		many = append(many, imagetest.File(fmt.Sprint(i), "", 0o644))
	}
	// A tiny tar, then 64 MiB of zeros, gzip'd: a small blob that unpacks far past the cap.
	var trail bytes.Buffer
	zw := gzip.NewWriter(&trail)
	zw.Write(imagetest.Tar(t, []imagetest.Entry{imagetest.File("x", "x", 0o644)}))
	zeros := make([]byte, 1<<20)
	for range 64 {
		zw.Write(zeros)
	}
	zw.Close()
	small := []imagetest.Layer{{Entries: []imagetest.Entry{imagetest.File("small", "ok", 0o644)}}}
	for _, f := range formats {
		for name, layers := range map[string][]imagetest.Layer{
			"file": big, "entries": {{Entries: many}}, "trailing": {{Raw: trail.Bytes()}},
		} {
			t.Run(f.name+"/"+name, func(t *testing.T) {
				t.Parallel()
				src, _ := f.write(t, t.TempDir(), testConfig, layers...)
				dir := t.TempDir()
				_, err := importWithin(t, src, dir, WithMaxBytes(limit))
				if !errors.Is(err, ErrTooLarge) {
					t.Fatalf("Import over the cap: %v, want ErrTooLarge", err)
				}
				checkLeftEmpty(t, dir)
			})
		}
		t.Run(f.name+"/under", func(t *testing.T) {
			t.Parallel()
			src, _ := f.write(t, t.TempDir(), testConfig, small...)
			if _, err := importWithin(t, src, t.TempDir(), WithMaxBytes(limit)); err != nil {
				t.Fatalf("Import under the cap: %v", err)
			}
		})
	}
	t.Run("rootfs", func(t *testing.T) {
		src := t.TempDir()
		if err := os.WriteFile(filepath.Join(src, "big"), make([]byte, 2*limit), 0o644); err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		if _, err := importWithin(t, src, dir, WithMaxBytes(limit)); !errors.Is(err, ErrTooLarge) {
			t.Fatalf("rootfs over the cap: %v", err)
		}
		checkLeftEmpty(t, dir)
	})
}

// A FIFO where an image layout has a file, or inside a rootfs, neither hangs the import nor is
// read.
func TestImportFIFO(t *testing.T) {
	requireRoot(t)
	for _, name := range []string{"oci-layout", "index.json"} {
		t.Run(name, func(t *testing.T) {
			src := t.TempDir()
			imagetest.WriteOCILayout(t, src, testConfig, imagetest.Layer{Entries: []imagetest.Entry{imagetest.File("a", "a", 0o644)}})
			if err := os.Remove(filepath.Join(src, name)); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mkfifo(filepath.Join(src, name), 0o644); err != nil {
				t.Fatal(err)
			}
			// Without its file the layout is not recognised: the directory is copied as a
			// rootfs, its FIFO as a FIFO.
			imp, err := importWithin(t, src, t.TempDir())
			if err != nil {
				t.Fatalf("Import: %v", err)
			}
			if st := lstat(t, filepath.Join(imp.Layers[0], name)); st.Mode&unix.S_IFMT != unix.S_IFIFO {
				t.Fatalf("%s imported as mode %o", name, st.Mode)
			}
		})
	}
	t.Run("manifest.json", func(t *testing.T) {
		src := t.TempDir()
		if err := unix.Mkfifo(filepath.Join(src, "manifest.json"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := importWithin(t, src, t.TempDir()); err != nil {
			t.Fatalf("Import: %v", err)
		}
	})
	t.Run("blob", func(t *testing.T) {
		src := t.TempDir()
		img := imagetest.WriteOCILayout(t, src, testConfig, imagetest.Layer{Entries: []imagetest.Entry{imagetest.File("a", "a", 0o644)}})
		blob := filepath.Join(src, "blobs", "sha256", img.LayerDigests[0][len("sha256:"):])
		if err := os.Remove(blob); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mkfifo(blob, 0o644); err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		if _, err := importWithin(t, src, dir); !errors.Is(err, ErrInvalidImage) {
			t.Fatalf("a FIFO for a layer blob: %v, want ErrInvalidImage", err)
		}
		checkLeftEmpty(t, dir)
	})
}

// A docker save tarball's index of members is bounded: too many members is refused at once,
// and members with names longer than any image needs are not kept.
func TestImportTarIndexBounded(t *testing.T) {
	requireRoot(t)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := range maxMembers + 1 {
		tw.WriteHeader(&tar.Header{Name: fmt.Sprint("m", i), Typeflag: tar.TypeReg, Mode: 0o644})
	}
	tw.Close()
	src := filepath.Join(t.TempDir(), "flood.tar")
	if err := os.WriteFile(src, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if _, err := importWithin(t, src, dir); !errors.Is(err, ErrInvalidImage) {
		t.Fatalf("a tarball of %d members: %v, want ErrInvalidImage", maxMembers+1, err)
	}
	checkLeftEmpty(t, dir)

	f, err := os.Open(writeLongNames(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s, err := openTarSource(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.members) != 1 {
		t.Fatalf("%d members kept, want only the short name", len(s.members))
	}
}

func writeLongNames(t *testing.T) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := range 20 {
		name := fmt.Sprintf("%d-%s", i, bytes.Repeat([]byte("n"), maxMemberName))
		tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatPAX})
	}
	tw.WriteHeader(&tar.Header{Name: "manifest.json", Typeflag: tar.TypeReg, Mode: 0o644})
	tw.Close()
	p := filepath.Join(t.TempDir(), "long.tar")
	if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}
