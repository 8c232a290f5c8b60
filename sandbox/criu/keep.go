package criu

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// logKeeper keeps copies of the logs of failed requests in dir, the newest
// max of them.
type logKeeper struct {
	dir string
	max int
	seq atomic.Uint64
}

// keep copies log into the keeper's directory and returns the copy's path.
// what names the request (DUMP, RESTORE) in the copy's name.
func (k *logKeeper) keep(log, what string) (string, error) {
	b, err := os.ReadFile(log)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(k.dir, 0o700); err != nil {
		return "", err
	}
	// Names sort by time: the trim drops the oldest.
	name := fmt.Sprintf("%s-%06d-%s.log", time.Now().UTC().Format("20060102T150405.000000000"), k.seq.Add(1)%1000000, strings.ToLower(what))
	p := filepath.Join(k.dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		return "", err
	}
	k.trim()
	return p, nil
}

// trim removes the oldest copies past max. Trims at once each remove the
// oldest of what they listed, which leaves no more than max and drops none
// of the newest max.
func (k *logKeeper) trim() {
	ents, err := os.ReadDir(k.dir)
	if err != nil {
		return
	}
	var names []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".log") {
			names = append(names, e.Name())
		}
	}
	slices.Sort(names)
	for len(names) > k.max {
		_ = os.Remove(filepath.Join(k.dir, names[0]))
		names = names[1:]
	}
}
