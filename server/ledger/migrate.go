package ledger

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// migrationLockKey is the advisory lock that serialises migrations of one database ("dgledger").
const migrationLockKey int64 = 0x64676c6564676572

type migration struct {
	version int
	name    string
	sql     string
}

func migrations() ([]migration, error) {
	entries, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		return nil, fmt.Errorf("reading embedded migrations: %w", err)
	}
	var out []migration
	for _, e := range entries {
		num, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %s: name must start with a number and _", e.Name())
		}
		b, err := migrationFS.ReadFile("migrations/" + e.Name())
		if err != nil {
			return nil, fmt.Errorf("reading migration %s: %w", e.Name(), err)
		}
		out = append(out, migration{version: v, name: e.Name(), sql: string(b)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].version < out[j].version })
	return out, nil
}

// Migrate brings the ledger schema up to date, in one transaction under an advisory lock so that
// servers starting together do not race. Applied versions are recorded in schema_migrations. It
// returns the names of the migrations it applied (none when the schema was up to date).
func Migrate(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	ms, err := migrations()
	if err != nil {
		return nil, err
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("beginning migration: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	// A migration that alters a table waits for its lock behind every session using it, and
	// every session after it waits behind the migration: give up after a while instead (and
	// MigrateURL tries again) so that a long query on an external database holds up neither.
	if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '"+migrationLockTimeout+"'"); err != nil {
		return nil, fmt.Errorf("setting the migration's lock timeout: %w", err)
	}
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", migrationLockKey); err != nil {
		return nil, fmt.Errorf("taking migration lock: %w", err)
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version integer PRIMARY KEY,
		name text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("creating schema_migrations: %w", err)
	}
	applied := map[int]bool{}
	var done []string
	rows, err := tx.Query(ctx, "SELECT version FROM schema_migrations")
	if err != nil {
		return nil, fmt.Errorf("reading schema_migrations: %w", err)
	}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			return nil, fmt.Errorf("reading schema_migrations: %w", err)
		}
		applied[v] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("reading schema_migrations: %w", err)
	}
	for _, m := range ms {
		if applied[m.version] {
			continue
		}
		if _, err := tx.Exec(ctx, m.sql); err != nil {
			return nil, fmt.Errorf("applying migration %s: %w", m.name, err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.version, m.name); err != nil {
			return nil, fmt.Errorf("recording migration %s: %w", m.name, err)
		}
		done = append(done, m.name)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("committing migrations: %w", err)
	}
	return done, nil
}

// migrationLockTimeout bounds one attempt's wait for a lock.
const migrationLockTimeout = "5s"

// migrationAttempts is how many times MigrateURL tries when a lock is not to be had: about a
// minute in all.
const migrationAttempts = 10

// MigrateURL connects to url and migrates, trying again for about a minute while other sessions
// hold a lock the migration needs, and disconnects.
func MigrateURL(ctx context.Context, url string) ([]string, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connecting to ledger database: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for attempt := 1; ; attempt++ {
		applied, err := Migrate(ctx, conn)
		var pe *pgconn.PgError
		if err == nil || !errors.As(err, &pe) || pe.Code != "55P03" { // lock_not_available
			return applied, err
		}
		if attempt == migrationAttempts {
			return nil, fmt.Errorf("another session held a lock the ledger's migration needs for %d attempts of %s (see pg_locks): %w",
				attempt, migrationLockTimeout, err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}
