package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Held memory: a memory group outside every sandbox's, for the processes a
// sandbox's commands must not reach, the templates of its checkpoints.
//
// The kernel's OOM killer, when a group reaches its memory limit, picks
// its victim among the processes of that group and its descendants, by a
// score that anyone who may write a process's /proc/PID/oom_score_adj can
// raise: a sandbox's root may for every process of its user namespace, a
// non-dumpable template included. So a template, whose pids stay the
// sandbox's, leaves the sandbox's memory group for /<Root>.held, a sibling
// of the manager's root (outside the runtime's own cap's scope too). Only
// where memory is a v1 controller: there a group's tasks may sit in one
// memory group and another tracking group, and moving a task leaves its
// pages charged where they were made (v1 moves no charge without
// memory.move_charge_at_immigrate, which is deprecated), so the template's
// memory — shared with the process it copies, or its own after that process
// wrote — still counts against the sandbox's limit. What the held group
// itself is charged is what the template's mm allocates after the move:
// huge-page folds (MADV_COLLAPSE charges the mm's group), and the page
// tables of copies forked from it (the clone runs in its context), within
// the cap SetBaseMemory gives it. Where memory is in the tracking
// hierarchy (unified mode) a task has one group for both, and HoldMemory
// does nothing.

// heldSuffix names the held group: Root plus a dot, which no group name
// has (validName).
const heldSuffix = ".held"

// heldDir returns the held group's directory, "" where memory is not a v1
// controller.
func (m *Manager) heldDir() string {
	r, ok := m.l.ctrl[ctrlMemory]
	if !ok || m.l.ctrlV2[ctrlMemory] {
		return ""
	}
	return filepath.Join(r, m.cfg.Root+heldSuffix)
}

// ensureHeld creates the held group if it is missing.
func (m *Manager) ensureHeld() error {
	d := m.heldDir()
	if d == "" {
		return nil
	}
	if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("creating held memory group %s: %w", d, err)
	}
	return nil
}

// removeHeld removes the held group once it holds no process.
func (m *Manager) removeHeld() error {
	d := m.heldDir()
	if d == "" {
		return nil
	}
	if err := unix.Rmdir(d); err != nil && err != unix.ENOENT && err != unix.EBUSY {
		return fmt.Errorf("removing held memory group %s: %w", d, &os.PathError{Op: "rmdir", Path: d, Err: err})
	}
	return nil
}

// HoldsMemory reports whether Cgroup.HoldMemory moves processes (memory
// is a v1 controller).
func (m *Manager) HoldsMemory() bool { return m.heldDir() != "" }

// HoldMemory moves process pid, a process of the group, into the held
// memory group, in the memory hierarchy only: no group's OOM kill reaches
// it, and its pages stay charged to the group that made them. Undone by
// JoinMemory.
func (c *Cgroup) HoldMemory(pid int) error {
	m := c.m
	d := m.heldDir()
	if d == "" {
		return nil
	}
	s := strconv.Itoa(pid)
	err := writeFile(filepath.Join(d, "cgroup.procs"), s)
	if errors.Is(err, os.ErrNotExist) {
		// Removed behind our back (RemoveBase of a closed manager of the
		// same Root): make it again.
		if err = m.ensureHeld(); err == nil {
			err = writeFile(filepath.Join(d, "cgroup.procs"), s)
		}
	}
	if err != nil {
		return fmt.Errorf("moving pid %s to the held memory group: %w", s, err)
	}
	return nil
}

// JoinMemory moves process pid into the group's memory group (its
// top-level group's), in the memory hierarchy only: a copy forked from a
// held process is born in the held group, and its own memory must count
// against its sandbox's limit. A no-op where HoldMemory is one.
func (c *Cgroup) JoinMemory(pid int) error {
	if c.m.heldDir() == "" {
		return nil
	}
	d, ok := c.limit[ctrlMemory]
	if !ok {
		return nil
	}
	s := strconv.Itoa(pid)
	return c.wrap("moving pid "+s+" to the memory group of", writeFile(filepath.Join(d, "cgroup.procs"), s))
}
