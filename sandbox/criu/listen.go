package criu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	sk_inet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	sk_unix "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-unix"
	"google.golang.org/protobuf/proto"
)

// Listener is a socket that a one-process image holds unbound on FD and
// that its restore is to bind and listen on: a TCP socket's address (IP,
// 4 or 16 bytes, and Port) with its options, or a unix socket's Path, with
// its file's Mode, UID and GID (as the sandbox sees them; Mode 0 if not
// known). It is how an image is made of a process whose listening sockets
// another process holds at the time: the live one, whose copy cannot bind
// them beside it.
type Listener struct {
	FD      int
	Backlog int

	IP                              []byte
	Port                            int
	ReuseAddr, ReusePort, KeepAlive bool
	FreeBind                        bool
	V6Only                          *bool

	Path           string
	Mode, UID, GID uint32
}

// tcpListen is the kernel's TCP_LISTEN, the state of a listening socket
// of either family in criu's images.
const tcpListen = 10

// SetListening rewrites the images in dir, of one process, so that the
// sockets of ls are restored listening: criu binds each to its address
// and listens, as for a socket it found listening.
func SetListening(dir string, ls []Listener) error {
	if len(ls) == 0 {
		return nil
	}
	infos, err := filepath.Glob(filepath.Join(dir, "fdinfo-*.img"))
	if err != nil {
		return err
	}
	if len(infos) != 1 {
		return fmt.Errorf("%d fd tables in the image, want one", len(infos))
	}
	fds, err := decodeImage(infos[0], &fdinfo.FdinfoEntry{})
	if err != nil {
		return err
	}
	byID := map[uint32]Listener{}
	for _, l := range ls {
		found := false
		for _, e := range fds.Entries {
			if fe := e.Message.(*fdinfo.FdinfoEntry); int(fe.GetFd()) == l.FD {
				byID[fe.GetId()], found = l, true
			}
		}
		if !found {
			return fmt.Errorf("fd %d is not in the image", l.FD)
		}
	}
	path := filepath.Join(dir, "files.img")
	files, err := decodeImage(path, &fdinfo.FileEntry{})
	if err != nil {
		return err
	}
	done := 0
	for _, e := range files.Entries {
		f := e.Message.(*fdinfo.FileEntry)
		l, ok := byID[f.GetId()]
		if !ok {
			continue
		}
		if err := setListening(f, l); err != nil {
			return fmt.Errorf("fd %d: %w", l.FD, err)
		}
		done++
	}
	if done != len(byID) {
		return errors.New("a listening socket's file is not in the image")
	}
	return encodeImage(path, files)
}

func setListening(f *fdinfo.FileEntry, l Listener) error {
	switch {
	case f.Isk != nil && l.Path == "":
		sk := f.Isk
		if len(l.IP) != 4 && len(l.IP) != 16 || len(l.IP) != 4*len(sk.SrcAddr) && len(sk.SrcAddr) != 0 {
			return fmt.Errorf("an address of %d bytes for a socket of family %d", len(l.IP), sk.GetFamily())
		}
		// criu keeps an address as the kernel's 32-bit words, in
		// memory order.
		addr := make([]uint32, len(l.IP)/4)
		for i := range addr {
			addr[i] = binary.NativeEndian.Uint32(l.IP[4*i:])
		}
		sk.State, sk.SrcPort, sk.SrcAddr = proto.Uint32(tcpListen), proto.Uint32(uint32(l.Port)), addr
		sk.DstPort, sk.DstAddr = proto.Uint32(0), make([]uint32, len(addr))
		sk.Backlog = proto.Uint32(uint32(l.Backlog))
		if sk.Opts != nil {
			sk.Opts.Reuseaddr, sk.Opts.SoReuseport, sk.Opts.SoKeepalive = proto.Bool(l.ReuseAddr), proto.Bool(l.ReusePort), proto.Bool(l.KeepAlive)
		}
		if l.FreeBind {
			if sk.IpOpts == nil {
				sk.IpOpts = &sk_inet.IpOptsEntry{}
			}
			sk.IpOpts.Freebind = proto.Bool(true)
		}
		if l.V6Only != nil {
			sk.V6Only = proto.Bool(*l.V6Only)
		}
		return nil
	case f.Usk != nil && l.Path != "":
		sk := f.Usk
		sk.State, sk.Name, sk.Backlog = proto.Uint32(tcpListen), []byte(l.Path), proto.Uint32(uint32(l.Backlog))
		if l.Mode != 0 { // else unknown (a record that did not keep it): as criu makes it
			sk.FilePerms = &sk_unix.FilePermsEntry{Mode: proto.Uint32(l.Mode), Uid: proto.Uint32(l.UID), Gid: proto.Uint32(l.GID)}
		}
		sk.Deleted, sk.NameDir = nil, nil
		return nil
	}
	return errors.New("not a socket of the listener's kind")
}

// clearSocketFiles removes, in the root of process nsPid (resolved there,
// never outside it), the socket file at each absolute path a unix socket of
// the images in dir is bound to, which criu binds again: a file there (the
// checkpoint's copy of the file, to which no socket is bound) would fail
// the bind with EADDRINUSE. Only a socket is removed; anything else at the
// path stays, and criu's bind fails on it, saying so.
func clearSocketFiles(dir string, nsPid int) error {
	img, err := decodeImage(filepath.Join(dir, "files.img"), &fdinfo.FileEntry{})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	root := -1
	defer func() {
		if root >= 0 {
			unix.Close(root)
		}
	}()
	for _, e := range img.Entries {
		u := e.Message.(*fdinfo.FileEntry).GetUsk()
		name := string(u.GetName())
		if u == nil || u.GetDeleted() || !strings.HasPrefix(name, "/") || strings.IndexByte(name, 0) >= 0 {
			continue
		}
		if root < 0 {
			if root, err = unix.Open("/proc/"+strconv.Itoa(nsPid)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
				return err
			}
		}
		if err := removeSocketFile(root, name); err != nil {
			return fmt.Errorf("removing the socket file %s: %w", name, err)
		}
	}
	return nil
}

// removeSocketFile removes the file at path below root if it is a socket.
func removeSocketFile(root int, p string) error {
	p = path.Clean(p)
	d, err := unix.Openat2(root, strings.TrimLeft(path.Dir(p), "/")+"/.", &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(d)
	base := path.Base(p)
	var st unix.Stat_t
	if err := unix.Fstatat(d, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return nil
	}
	if err := unix.Unlinkat(d, base, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return err
	}
	return nil
}
