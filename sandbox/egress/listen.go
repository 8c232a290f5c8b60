package egress

import (
	"fmt"
	"net"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// Listen opens a TCP listener on 127.0.0.1:ProxyPort inside the net namespace netns (an open
// descriptor of it). The socket belongs to that namespace for its whole life, wherever the
// process that holds it runs; the namespace stays alive while it is open.
func Listen(netns int) (net.Listener, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		fd, back, err := listenIn(netns)
		if back {
			// Only a thread back in the host's namespace may run other goroutines; one that
			// could not come back dies with this goroutine, still locked.
			runtime.UnlockOSThread()
		}
		ch <- result{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		return nil, r.err
	}
	f := os.NewFile(uintptr(r.fd), "egress-listener")
	defer f.Close()
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("adopting the egress listener: %w", err)
	}
	return ln, nil
}

// listenIn makes the listening socket in netns from the calling (locked) thread; back reports
// whether the thread is in its own namespace again.
func listenIn(netns int) (fd int, back bool, err error) {
	home, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, true, fmt.Errorf("opening the host's net namespace: %w", err)
	}
	defer unix.Close(home)
	if err := unix.Setns(netns, unix.CLONE_NEWNET); err != nil {
		return -1, true, fmt.Errorf("entering the sandbox's net namespace: %w", err)
	}
	fd, err = socketIn()
	if herr := unix.Setns(home, unix.CLONE_NEWNET); herr != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return -1, false, fmt.Errorf("leaving the sandbox's net namespace: %w", herr)
	}
	return fd, true, err
}

func socketIn() (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return -1, fmt.Errorf("egress listener socket: %w", err)
	}
	sa := &unix.SockaddrInet4{Port: ProxyPort, Addr: [4]byte{127, 0, 0, 1}}
	if err := unix.Bind(fd, sa); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("binding the egress listener to 127.0.0.1:%d: %w", ProxyPort, err)
	}
	if err := unix.Listen(fd, 128); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("listening for egress: %w", err)
	}
	return fd, nil
}
