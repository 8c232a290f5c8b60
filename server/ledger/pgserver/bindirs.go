package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// checkBinDirs makes the bin directories absolute (initdb and postgres run with / as their
// working directory) and checks that each holds both binaries.
func checkBinDirs(dirs []string) ([]string, error) {
	if len(dirs) == 0 {
		return nil, fmt.Errorf("%w: no bin directory was given (Config.BinDirs)", ErrNoBinaries)
	}
	abs := make([]string, len(dirs))
	for i, d := range dirs {
		a, err := filepath.Abs(d)
		if err != nil {
			return nil, fmt.Errorf("resolving bin dir %s: %w", d, err)
		}
		if err := hasBinaries(a); err != nil {
			return nil, err
		}
		abs[i] = a
	}
	return abs, nil
}

func hasBinaries(dir string) error {
	for _, b := range []string{"initdb", "postgres"} {
		fi, err := os.Stat(filepath.Join(dir, b))
		if err != nil {
			return fmt.Errorf("looking for %s in %s: %w", b, dir, ErrNoBinaries)
		}
		if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
			return fmt.Errorf("%s in %s is not an executable file: %w", b, dir, ErrNoBinaries)
		}
	}
	return nil
}

var versionLine = regexp.MustCompile(`\(PostgreSQL\) (\d+)`)

// BinaryMajor returns the major version of the postgres binary in dir (17 for 17.12).
func BinaryMajor(ctx context.Context, dir string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(dir, "postgres"), "-V")
	cmd.Env = []string{"LC_ALL=C", "PATH=/usr/bin:/bin"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		// The private install's binaries name its loader by absolute path: a moved checkout
		// fails here with "no such file or directory".
		return 0, fmt.Errorf("running %s -V (for a checkout's .cache/postgres that was moved, run `make postgres` again): %w: %s",
			filepath.Join(dir, "postgres"), err, bytes.TrimSpace(out))
	}
	m := versionLine.FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("%s -V said %q, not a PostgreSQL version", filepath.Join(dir, "postgres"), bytes.TrimSpace(out))
	}
	return strconv.Atoi(string(m[1]))
}

// clusterMajor returns the major version that made the cluster in pgdata (its PG_VERSION), or 0
// when there is no cluster yet.
func clusterMajor(pgdata string) (int, error) {
	b, err := os.ReadFile(filepath.Join(pgdata, "PG_VERSION"))
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading the cluster's version: %w", err)
	}
	m, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil {
		return 0, fmt.Errorf("%s/PG_VERSION holds %q, not a major version", pgdata, bytes.TrimSpace(b))
	}
	return m, nil
}

// chooseBinDir returns the bin directory of c.BinDirs that runs the cluster in pgdata, and its
// major version: the first directory for a new cluster; for an existing one, the first of the
// cluster's own major version, since a cluster made by another major version cannot be opened
// (a cluster that Debian's PostgreSQL 15 made keeps working with 17 preferred). Without one, it
// fails with ErrVersion, naming the versions it was given.
func (c *Config) chooseBinDir(ctx context.Context, pgdata string) (string, int, error) {
	first, err := BinaryMajor(ctx, c.BinDirs[0])
	if err != nil {
		return "", 0, err
	}
	have, err := clusterMajor(pgdata)
	if err != nil || have == 0 || have == first {
		return c.BinDirs[0], first, err
	}
	given := []string{fmt.Sprintf("%s (%d)", c.BinDirs[0], first)}
	for _, d := range c.BinDirs[1:] {
		m, err := BinaryMajor(ctx, d)
		if err != nil {
			given = append(given, fmt.Sprintf("%s (%v)", d, err))
			continue
		}
		if m == have {
			c.Logger.Warn("private postgres: the cluster was made by another major version than the preferred binaries'; running it with that version's",
				"dir", pgdata, "cluster", have, "bin", d, "preferred", c.BinDirs[0], "preferred_version", first)
			return d, have, nil
		}
		given = append(given, fmt.Sprintf("%s (%d)", d, m))
	}
	return "", 0, fmt.Errorf("%w: the cluster in %s was made by PostgreSQL %d, and no bin directory given holds that version (given: %s); "+
		"give PostgreSQL %d's, or move the cluster away to start a new one",
		ErrVersion, pgdata, have, strings.Join(given, ", "), have)
}
