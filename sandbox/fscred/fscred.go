// Package fscred runs filesystem work with another host uid and gid as the
// filesystem credentials (fsuid, fsgid) of one locked OS thread, leaving the
// rest of the process as it is.
//
// Both the overlay mounter and the server's file actions need it: overlayfs
// works in its upper with its mounter's credentials, and a sandbox's files
// must be read and written as the sandbox's user (its host ids, seen through
// idmapped layers).
package fscred

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// Run runs fn with fsuid uid and fsgid gid. Moving fsuid away from 0 drops
// the file capabilities (CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_MKNOD, …) from the
// effective set; keepCaps raises them again from the permitted set. The
// thread goes back to fsuid 0 with its capabilities afterwards and is handed
// back to the runtime; a thread that cannot be restored ends with its
// goroutine instead.
func Run(uid, gid int, keepCaps bool, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		err, clean := run(uid, gid, keepCaps, fn)
		if clean {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

func run(uid, gid int, keepCaps bool, fn func() error) (err error, clean bool) {
	if err := unix.Setfsgid(gid); err != nil {
		return fmt.Errorf("setfsgid: %w", err), false
	}
	if err := unix.Setfsuid(uid); err != nil {
		return fmt.Errorf("setfsuid: %w", err), false
	}
	if keepCaps {
		if err := RaiseCaps(); err != nil {
			return err, false
		}
	}
	err = fn()
	// Back to fsuid 0: the kernel restores the file capabilities to the
	// effective set; raise the rest too.
	unix.Setfsuid(0)
	unix.Setfsgid(0)
	return err, RaiseCaps() == nil
}

// RaiseCaps makes the calling thread's effective capabilities its permitted
// ones.
func RaiseCaps() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[0].Effective = data[0].Permitted
	data[1].Effective = data[1].Permitted
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}
