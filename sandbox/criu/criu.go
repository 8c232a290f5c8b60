// Package criu checkpoints and restores process trees with CRIU 4.2.1+ (Debian sid's build,
// installed into a private prefix by scripts/criu.sh; see docs/CRIU.md).
//
// Two ways to talk to CRIU over its RPC protocol are offered:
//
//   - Service keeps one `criu service` process alive and sends each request over its unix socket;
//     the service forks a worker per request.
//   - Swrk starts a fresh `criu swrk` worker per request through go-criu (a swrk worker serves a
//     single dump or restore).
//
// Both dump with --network-lock skip (the sandbox's net namespace is private, so there is nothing
// to lock) and restore detached. A Service restore is a child of the criu service process, which
// reaps it; a Swrk restore is a child of the caller (rst_sibling), who must reap it. Only a Swrk's
// tree requests cache CRIU's kernel feature detection (Swrk.CacheFeatures), otherwise a fixed part
// of every call: see docs/CRIU.md ("Go: package sandbox/criu") and, for what a call costs,
// docs/PERFORMANCE.md ("CRIU alone").
package criu

import (
	"fmt"
	"path/filepath"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"
)

// DumpOpts describes one dump.
type DumpOpts struct {
	// Pid is the host pid of the tree's root, normally pid 1 of the sandbox's namespaces.
	Pid int
	// ImagesDir is an existing directory that receives the images and dump.log.
	ImagesDir string
	// LeaveRunning keeps the tree running after the dump instead of killing it.
	LeaveRunning bool
	// External lists resources CRIU must not dump, in its --external syntax, e.g.
	// "net[4026532000]:sbxnet" for a net namespace owned by the caller.
	External []string
}

// Validate reports whether the options can be sent.
func (o DumpOpts) Validate() error {
	if o.Pid <= 0 {
		return fmt.Errorf("%w: dump pid %d", ErrInvalidConfig, o.Pid)
	}
	if !filepath.IsAbs(o.ImagesDir) {
		return fmt.Errorf("%w: images dir %q is not absolute", ErrInvalidConfig, o.ImagesDir)
	}
	return nil
}

func (o DumpOpts) rpc() *rpc.CriuOpts {
	return &rpc.CriuOpts{
		ImagesDirFd:  proto.Int32(-1),
		ImagesDir:    proto.String(o.ImagesDir),
		Pid:          proto.Int32(int32(o.Pid)),
		LeaveRunning: proto.Bool(o.LeaveRunning),
		NetworkLock:  rpc.CriuNetworkLockMethod_SKIP.Enum(),
		External:     o.External,
		LogFile:      proto.String("dump.log"),
		LogLevel:     proto.Int32(2),
	}
}

// RestoreOpts describes one restore.
type RestoreOpts struct {
	// ImagesDir holds the images of an earlier dump; restore.log is written there.
	ImagesDir string
	// Root is the directory that becomes the root mount of the restored mount namespace.
	Root string
}

// Validate reports whether the options can be sent.
func (o RestoreOpts) Validate() error {
	if !filepath.IsAbs(o.ImagesDir) {
		return fmt.Errorf("%w: images dir %q is not absolute", ErrInvalidConfig, o.ImagesDir)
	}
	if !filepath.IsAbs(o.Root) {
		return fmt.Errorf("%w: root %q is not absolute", ErrInvalidConfig, o.Root)
	}
	return nil
}

func (o RestoreOpts) rpc() *rpc.CriuOpts {
	return &rpc.CriuOpts{
		ImagesDirFd: proto.Int32(-1),
		ImagesDir:   proto.String(o.ImagesDir),
		Root:        proto.String(o.Root),
		NetworkLock: rpc.CriuNetworkLockMethod_SKIP.Enum(),
		LogFile:     proto.String("restore.log"),
		LogLevel:    proto.Int32(2),
	}
}
