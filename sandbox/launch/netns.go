package launch

import (
	"fmt"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// NetPool keeps net namespaces ready, loopback up and nothing else: a new
// one is slow to make and is torn down asynchronously, so sandbox creation
// takes one from the pool and a goroutine refills it.
type NetPool struct {
	ready  chan int
	refill chan struct{}
	done   chan struct{}
	wg     sync.WaitGroup
	once   sync.Once
}

// NewNetPool starts a pool that keeps size namespaces ready.
func NewNetPool(size int) *NetPool {
	if size < 1 {
		size = 1
	}
	p := &NetPool{ready: make(chan int, size), refill: make(chan struct{}, 1), done: make(chan struct{})}
	p.wg.Add(1)
	go p.populate()
	return p
}

func (p *NetPool) populate() {
	defer p.wg.Done()
	for {
		for len(p.ready) < cap(p.ready) {
			fd, err := NewNetNS()
			if err != nil {
				// Get makes one itself and reports the error to its caller.
				break
			}
			select {
			case p.ready <- fd:
			case <-p.done:
				unix.Close(fd)
				return
			}
		}
		select {
		case <-p.refill:
		case <-p.done:
			return
		}
	}
}

// Get returns a net namespace fd, owned by the caller.
func (p *NetPool) Get() (int, error) {
	select {
	case fd := <-p.ready:
		select {
		case p.refill <- struct{}{}:
		default:
		}
		return fd, nil
	default:
	}
	select {
	case p.refill <- struct{}{}:
	default:
	}
	return NewNetNS()
}

// Put gives back the net namespace of a sandbox that has ended, for reuse:
// making one and tearing it down costs more than a sandbox's whole start.
// A sandbox cannot change its net namespace (it is owned by the host's user
// namespace, so the sandbox's root has no CAP_NET_ADMIN over it): once its
// processes are gone, only loopback, up, is left — and sockets in TIME_WAIT
// for a minute, which is all a later sandbox could notice. Put closes fd when
// the pool is full or closed.
func (p *NetPool) Put(fd int) {
	select {
	case <-p.done:
		unix.Close(fd)
		return
	default:
	}
	select {
	case p.ready <- fd:
	default:
		unix.Close(fd)
	}
}

// Close stops the pool and releases the namespaces it holds. Idempotent.
func (p *NetPool) Close() error {
	p.once.Do(func() {
		close(p.done)
		p.wg.Wait()
		for {
			select {
			case fd := <-p.ready:
				unix.Close(fd)
			default:
				return
			}
		}
	})
	return nil
}

// NewNetNS makes a net namespace with only loopback, up.
func NewNetNS() (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with its netns
		fd, err := newNetNSLocked()
		ch <- result{fd, err}
	}()
	r := <-ch
	return r.fd, r.err
}

func newNetNSLocked() (int, error) {
	// This may be the main thread, which outlives the goroutine: come back
	// to the host's net namespace once the new one is open.
	home, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(home)
	fd, err := newNetNSIn()
	if herr := unix.Setns(home, unix.CLONE_NEWNET); herr != nil {
		panic(fmt.Sprintf("leaving a new net namespace: %v", herr))
	}
	return fd, err
}

func newNetNSIn() (int, error) {
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return -1, fmt.Errorf("creating net namespace: %w", err)
	}
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket in net namespace: %w", err)
	}
	defer unix.Close(s)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return -1, err
	}
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return -1, fmt.Errorf("reading lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return -1, fmt.Errorf("bringing lo up: %w", err)
	}
	return unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
}
