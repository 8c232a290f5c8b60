// Package servertest starts a real in-process deltagym server — sandbox
// runtime, warm pools on the default image, private Postgres — on a loopback
// port, for the integration tests of the clients and the CLI.
package servertest

import (
	"cmp"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server"
)

// Options adjust the test server.
type Options struct {
	// EnvsDir is the env catalog; default: the repository's envs/.
	EnvsDir string
	// AuthToken, when set, is the bearer token the server requires; by default the server
	// makes one and keeps it in DataDir/token (Server.Token returns it).
	AuthToken string
	// ImportRoot is where ImportImage may read images; default: the directory holding the
	// default image's rootfs, so that tests can import it again.
	ImportRoot string
	// LeaseTTL overrides the server's lease TTL.
	LeaseTTL time.Duration
}

// Server is a running test server.
type Server struct {
	*server.Server
	// Addr is its loopback host:port.
	Addr string
	// DataDir is its data directory (removed by Close).
	DataDir string
	// InitBinary is the dg-init it runs sandboxes with.
	InitBinary string
	// ImageDir is the rootfs it imported as image "default".
	ImageDir string

	served chan error
	log    *os.File
}

// Start starts a server. Where one cannot run here (not root; init, default
// image or postgres missing) it returns a nil Server and the reason.
func Start(ctx context.Context, opts Options) (*Server, string, error) {
	if r := testenv.PrivilegedReason("sandboxes need namespaces, mounts and cgroups"); r != "" {
		return nil, r, nil
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, "", err
	}
	initBin, err := locate.Init()
	if err != nil {
		return nil, err.Error(), nil
	}
	image := filepath.Join(root, ".data", "images", "default", "rootfs")
	if d := os.Getenv("DATA"); d != "" {
		image = filepath.Join(d, "images", "default", "rootfs")
	}
	if _, err := os.Stat(image); err != nil {
		return nil, "the default image is not built (make image)", nil
	}
	pgBin, err := locate.PostgresBinDirs()
	if err != nil {
		return nil, err.Error(), nil
	}
	criu, _ := locate.CRIU() // where it is expected if not installed: forks that need it fail
	if opts.EnvsDir == "" {
		opts.EnvsDir = filepath.Join(root, "envs")
	}
	data, err := os.MkdirTemp("", "dgtestsrv-")
	if err != nil {
		return nil, "", err
	}
	logFile, err := os.Create(filepath.Join(data, "server.log"))
	if err != nil {
		return nil, "", errors.Join(err, os.RemoveAll(data))
	}
	srv, err := server.New(ctx, server.Config{
		DataDir:         data,
		EnvsDir:         opts.EnvsDir,
		InitBinary:      initBin,
		CRIU:            criu,
		PostgresBinDirs: pgBin,
		DefaultImageDir: image,
		AuthToken:       opts.AuthToken,
		Import:          server.ImportSettings{Root: cmp.Or(opts.ImportRoot, filepath.Dir(image))},
		Lease:           server.LeaseSettings{TTL: opts.LeaseTTL},
		AcquireTimeout:  time.Minute,
		Logger:          slog.New(slog.NewTextHandler(logFile, nil)),
	})
	if err != nil {
		logFile.Close()
		return nil, "", errors.Join(err, purge(data))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		logFile.Close()
		return nil, "", errors.Join(err, srv.Close(ctx), purge(data))
	}
	s := &Server{Server: srv, Addr: ln.Addr().String(), DataDir: data, InitBinary: initBin, ImageDir: image,
		served: make(chan error, 1), log: logFile}
	go func() { s.served <- srv.Serve(ln) }()
	return s, "", nil
}

// Close stops the server and removes its data directory, with the
// checkpoint layers the runtime keeps mounted for a restart. On an error the
// server's log goes to stderr.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := s.Server.Close(ctx)
	<-s.served
	s.log.Close()
	if err != nil {
		if f, oerr := os.Open(s.log.Name()); oerr == nil {
			_, _ = io.Copy(os.Stderr, f)
			f.Close()
		}
	}
	return errors.Join(err, purge(s.DataDir))
}

// purge removes a server data directory; the runtime's part of it holds
// tmpfs mounts (sandbox.Purge unmounts them).
func purge(data string) error {
	return errors.Join(sandbox.Purge(filepath.Join(data, "sandbox")), os.RemoveAll(data))
}

// RepoRoot returns the root of the checkout the test runs in (locate.Checkout).
func RepoRoot() (string, error) {
	if root := locate.Checkout(); root != "" {
		return root, nil
	}
	return "", errors.New("not inside a checkout: no go.mod above the working directory")
}
