package layers

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/benchq"
)

// benchLayer makes a sealed layer of files × size bytes, ten directories of
// files/10 each, contents random, and returns it with the bytes of its files.
func benchLayer(b *testing.B, s *Store, files, size int) (string, int64) {
	b.Helper()
	id, err := s.NewUpper(0, 0)
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, size)
	for i := range files {
		dir := filepath.Join(s.UpperPath(id), fmt.Sprintf("d%d", i%10))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			b.Fatal(err)
		}
		for j := range data {
			data[j] = byte(rng.Uint32())
		}
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%04d", i)), data, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := s.Seal(id); err != nil {
		b.Fatal(err)
	}
	return id, int64(files) * int64(size)
}

// BenchmarkExportImport sends a 50 MB layer (1,000 files of 50 KiB) from one
// store to another as a cross-node fork does: piped, Export on the sender
// (its digest known already) into Import on the receiver, which hashes,
// writes and seals it, both on this machine; export and import, each alone
// (across nodes they run on different machines). Each reports MB/s and
// p50/p99 per layer.
//
//	go test ./sandbox/layers/ -run '^$' -bench ExportImport -benchtime 30x
func BenchmarkExportImport(b *testing.B) {
	a, dst := newStore(b), newStore(b)
	src, n := benchLayer(b, a, 1000, 50<<10)
	defer a.Unref(src)
	var stream bytes.Buffer
	d, err := a.Export(&stream, src)
	if err != nil {
		b.Fatal(err)
	}
	// timed runs one transfer, what it makes dropped outside the timing.
	timed := func(b *testing.B, transfer func() (string, error)) {
		b.SetBytes(n)
		var lat []time.Duration
		for b.Loop() {
			start := time.Now()
			id, err := transfer()
			if err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(start))
			b.StopTimer()
			if id != "" {
				dst.Unref(id)
				dst.Wait()
			}
			b.StartTimer()
		}
		benchq.Report(b, lat, "")
	}
	b.Run("piped", func(b *testing.B) {
		timed(b, func() (string, error) {
			pr, pw := io.Pipe()
			sent := make(chan error, 1)
			go func() {
				_, err := a.Export(pw, src)
				pw.CloseWithError(err)
				sent <- err
			}()
			id, err := dst.Import(pr, d, 128<<20)
			pr.Close()
			return id, errors.Join(err, <-sent)
		})
	})
	b.Run("export", func(b *testing.B) {
		timed(b, func() (string, error) {
			_, err := a.Export(io.Discard, src)
			return "", err
		})
	})
	b.Run("import", func(b *testing.B) {
		timed(b, func() (string, error) {
			return dst.Import(bytes.NewReader(stream.Bytes()), d, 128<<20)
		})
	})
}

// BenchmarkDigest hashes a 50 MB layer whose digest is not known yet: what a
// node's first answer to "what is this layer's digest" costs.
//
//	go test ./sandbox/layers/ -run '^$' -bench Digest -benchtime 30x
func BenchmarkDigest(b *testing.B) {
	s := newStore(b)
	src, n := benchLayer(b, s, 1000, 50<<10)
	defer s.Unref(src)
	b.SetBytes(n)
	var lat []time.Duration
	b.ResetTimer()
	for b.Loop() {
		s.mu.Lock()
		s.forgetDigest(src)
		s.mu.Unlock()
		start := time.Now()
		if _, err := s.Digest(src); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	benchq.Report(b, lat, "")
}
