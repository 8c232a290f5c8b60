package ledger

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// Flusher is what a Store needs of a Writer: queries flush first so they see rows written just
// before them.
type Flusher interface {
	Flush(ctx context.Context) error
}

var _ Flusher = (*Writer)(nil)

// Store answers queries over the ledger.
type Store struct {
	pool    *pgxpool.Pool
	flusher Flusher
	owned   bool
}

// Open connects a pool to url, migrates the schema and returns a Store. If w is not nil, every
// query first flushes it. Close releases the pool.
func Open(ctx context.Context, url string, w Flusher) (*Store, error) {
	if _, err := MigrateURL(ctx, url); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parsing ledger URL: %w", err)
	}
	commitDurably(cfg.ConnConfig)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("opening ledger pool: %w", err)
	}
	return &Store{pool: pool, flusher: w, owned: true}, nil
}

// NewStore returns a Store over an existing, migrated pool (which the caller keeps and closes).
func NewStore(pool *pgxpool.Pool, w Flusher) *Store { return &Store{pool: pool, flusher: w} }

// Close releases the pool if Open made it. It is idempotent.
func (s *Store) Close() {
	if s.owned {
		s.pool.Close()
	}
}

func (s *Store) flush(ctx context.Context) error {
	if s.flusher == nil {
		return nil
	}
	return s.flusher.Flush(ctx)
}

// Episode is an episode as stored.
type Episode struct {
	ID              string       `json:"id"`
	Env             string       `json:"env"`
	Run             string       `json:"run,omitempty"`
	Group           string       `json:"group,omitempty"`
	Seed            int64        `json:"seed"`
	StartCheckpoint string       `json:"start_checkpoint,omitempty"`
	ParentEpisode   string       `json:"parent_episode,omitempty"`
	Sandbox         string       `json:"sandbox,omitempty"` // the sandbox it ran in
	Status          Status       `json:"status"`
	FailureClass    FailureClass `json:"failure_class,omitempty"`
	FailureMessage  string       `json:"failure_message,omitempty"`
	TotalReward     *float64     `json:"total_reward,omitempty"`
	StartedAt       time.Time    `json:"started_at"`
	EndedAt         *time.Time   `json:"ended_at,omitempty"`
	// Steps counts the steps the episode took itself (not those it
	// inherited from the checkpoint it started at).
	Steps int `json:"step_count"`
}

const episodeCols = `id, env, run, group_id, seed, coalesce(start_checkpoint, ''), coalesce(parent_episode, ''),
	coalesce(sandbox, ''), status, coalesce(failure_class, ''), coalesce(failure_message, ''), total_reward,
	started_at, ended_at, (SELECT count(*) FROM steps s WHERE s.episode_id = episodes.id)`

func scanEpisode(row pgx.Row) (Episode, error) {
	var e Episode
	var status, class string
	err := row.Scan(&e.ID, &e.Env, &e.Run, &e.Group, &e.Seed, &e.StartCheckpoint, &e.ParentEpisode,
		&e.Sandbox, &status, &class, &e.FailureMessage, &e.TotalReward, &e.StartedAt, &e.EndedAt, &e.Steps)
	e.Status, e.FailureClass = Status(status), FailureClass(class)
	e.StartedAt = e.StartedAt.UTC()
	if e.EndedAt != nil {
		t := e.EndedAt.UTC()
		e.EndedAt = &t
	}
	return e, err
}

// EpisodeFilter selects episodes; set fields are ANDed. PageSize defaults to 100 (max 1000).
type EpisodeFilter struct {
	Run       string
	Group     string
	Env       string
	PageSize  int
	PageToken string // from the previous page; "" for the first
}

// ListEpisodes returns a page of episodes ordered by start time, and the token of the next page
// ("" on the last page).
func (s *Store) ListEpisodes(ctx context.Context, f EpisodeFilter) ([]Episode, string, error) {
	for _, err := range []error{checkText("run", f.Run), checkText("group_id", f.Group), checkText("env", f.Env)} {
		if err != nil {
			return nil, "", err
		}
	}
	if err := s.flush(ctx); err != nil {
		return nil, "", err
	}
	size := f.PageSize
	if size <= 0 {
		size = 100
	}
	size = min(size, 1000)
	where := []string{"true"}
	var args []any
	add := func(cond string, v any) {
		args = append(args, v)
		where = append(where, fmt.Sprintf(cond, len(args)))
	}
	if f.Run != "" {
		add("run = $%d", f.Run)
	}
	if f.Group != "" {
		add("group_id = $%d", f.Group)
	}
	if f.Env != "" {
		add("env = $%d", f.Env)
	}
	if f.PageToken != "" {
		at, id, err := decodeToken(f.PageToken)
		if err != nil {
			return nil, "", err
		}
		args = append(args, at, id)
		where = append(where, fmt.Sprintf("(started_at, id) > ($%d, $%d)", len(args)-1, len(args)))
	}
	args = append(args, size+1)
	q := fmt.Sprintf("SELECT %s FROM episodes WHERE %s ORDER BY started_at, id LIMIT $%d",
		episodeCols, strings.Join(where, " AND "), len(args))
	rows, err := s.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, "", fmt.Errorf("listing episodes: %w", err)
	}
	eps, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Episode, error) { return scanEpisode(r) })
	if err != nil {
		return nil, "", fmt.Errorf("listing episodes: %w", err)
	}
	next := ""
	if len(eps) > size {
		eps = eps[:size]
		last := eps[size-1]
		next = encodeToken(last.StartedAt, last.ID)
	}
	return eps, next, nil
}

func encodeToken(at time.Time, id string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(at.UTC().Format(time.RFC3339Nano) + "|" + id))
}

func decodeToken(tok string) (time.Time, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err == nil {
		ts, id, ok := strings.Cut(string(b), "|")
		if at, perr := time.Parse(time.RFC3339Nano, ts); ok && perr == nil && checkText("", id) == nil {
			return at, id, nil
		}
	}
	return time.Time{}, "", fmt.Errorf("page token: %w", ErrInvalid)
}

// Episode returns one episode.
func (s *Store) Episode(ctx context.Context, id string) (Episode, error) {
	if err := s.flush(ctx); err != nil {
		return Episode{}, err
	}
	return s.episode(ctx, id)
}

func (s *Store) episode(ctx context.Context, id string) (Episode, error) {
	if err := checkText("episode_id", id); err != nil {
		return Episode{}, err
	}
	e, err := scanEpisode(s.pool.QueryRow(ctx, "SELECT "+episodeCols+" FROM episodes WHERE id = $1", id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Episode{}, errdefs.WithDetail(fmt.Errorf("episode %s: %w", id, ErrNotFound), "EPISODE_NOT_FOUND", "episode_id", id)
	}
	if err != nil {
		return Episode{}, fmt.Errorf("reading episode %s: %w", id, err)
	}
	return e, nil
}

// CheckpointPlace is where a checkpoint was taken, as the ledger recorded it: its env, and,
// for one taken in an episode, that episode, its run and group, the episode's own steps then
// (Own), and the steps on its path from the Reset then, inherited ones included (Global: the
// index of the next step after restoring it), of which Agent are the agent's (the rest set the
// task up: StepRow.Setup).
type CheckpointPlace struct {
	Env, Episode, Run, Group string
	Own, Global, Agent       int
}

// CheckpointPlace returns where checkpoint id was taken (ErrNotFound if the ledger has no
// record of it): what a restarted server knows of the checkpoints taken before. It reads what
// is delivered, without waiting for the writer (those checkpoints were recorded by an earlier
// run). A checkpoint whose episode is not in the ledger has its env only.
func (s *Store) CheckpointPlace(ctx context.Context, id string) (CheckpointPlace, error) {
	var p CheckpointPlace
	ep, own, err := s.checkpointAt(ctx, id, &p.Env)
	if err != nil || ep == "" {
		return p, err
	}
	e, err := s.episode(ctx, ep)
	if errors.Is(err, ErrNotFound) {
		return p, nil
	}
	if err != nil {
		return p, err
	}
	p.Episode, p.Run, p.Group, p.Own, p.Global = ep, e.Run, e.Group, own, own
	setup, err := s.setupSteps(ctx, ep, own)
	if err != nil {
		return p, err
	}
	seen := map[string]bool{ep: true}
	for range maxAncestry {
		if e.StartCheckpoint == "" {
			break
		}
		var env string
		up, limit, err := s.checkpointAt(ctx, e.StartCheckpoint, &env)
		if errors.Is(err, ErrNotFound) || (err == nil && (up == "" || seen[up])) {
			break
		}
		if err != nil {
			return p, err
		}
		p.Global += limit
		n, err := s.setupSteps(ctx, up, limit)
		if err != nil {
			return p, err
		}
		setup += n
		seen[up] = true
		if e, err = s.episode(ctx, up); errors.Is(err, ErrNotFound) {
			break
		} else if err != nil {
			return p, err
		}
	}
	p.Agent = p.Global - setup
	return p, nil
}

// setupSteps counts the setup steps among episode ep's first limit steps.
func (s *Store) setupSteps(ctx context.Context, ep string, limit int) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, "SELECT count(*) FROM steps WHERE episode_id = $1 AND idx < $2 AND setup", ep, limit).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("counting the setup steps of %s: %w", ep, err)
	}
	return n, nil
}

// checkpointAt reads checkpoint id's episode (empty if none) and step index, and its env
// into env.
func (s *Store) checkpointAt(ctx context.Context, id string, env *string) (string, int, error) {
	if err := checkText("checkpoint_id", id); err != nil {
		return "", 0, err
	}
	var ep *string
	var step *int32
	err := s.pool.QueryRow(ctx, "SELECT env, episode_id, step_index FROM checkpoints WHERE id = $1", id).Scan(env, &ep, &step)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0, errdefs.WithDetail(fmt.Errorf("checkpoint %s: %w", id, ErrNotFound), "CHECKPOINT_NOT_FOUND", "checkpoint_id", id)
	}
	if err != nil {
		return "", 0, fmt.Errorf("reading checkpoint %s: %w", id, err)
	}
	if ep == nil {
		return "", 0, nil
	}
	n := 0
	if step != nil {
		n = int(*step)
	}
	return *ep, n, nil
}

// TrajectoryStep is one step on a trajectory's path. Inherited steps belong to an ancestor
// episode (StepRow.EpisodeID) and were taken before the checkpoint this episode started from.
type TrajectoryStep struct {
	StepRow
	Inherited bool `json:"inherited"`
}

// Trajectory is the full path of an episode from its Reset.
type Trajectory struct {
	Episode Episode          `json:"episode"`
	Steps   []TrajectoryStep `json:"steps"`
	Rewards []RewardRow      `json:"rewards"`
}

// maxAncestry bounds the walk up the branch chain (a guard against a cycle in bad data).
const maxAncestry = 10_000

// Trajectory returns the episode's full path: the steps of the episodes it descends from, each
// up to the checkpoint the next one started from (marked Inherited), then its own steps.
func (s *Store) Trajectory(ctx context.Context, episodeID string) (*Trajectory, error) {
	if err := s.flush(ctx); err != nil {
		return nil, err
	}
	ep, err := s.episode(ctx, episodeID)
	if err != nil {
		return nil, err
	}
	type segment struct {
		episode string
		limit   int // steps with idx < limit; -1 for all
	}
	path := []segment{{episodeID, -1}}
	seen := map[string]bool{episodeID: true}
	cur := ep
	for range maxAncestry {
		if cur.StartCheckpoint == "" {
			break
		}
		var ckEpisode *string
		var ckStep *int32
		err := s.pool.QueryRow(ctx, "SELECT episode_id, step_index FROM checkpoints WHERE id = $1", cur.StartCheckpoint).Scan(&ckEpisode, &ckStep)
		if errors.Is(err, pgx.ErrNoRows) || (err == nil && (ckEpisode == nil || seen[*ckEpisode])) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading checkpoint %s: %w", cur.StartCheckpoint, err)
		}
		limit := 0
		if ckStep != nil {
			limit = int(*ckStep)
		}
		path = append(path, segment{*ckEpisode, limit})
		seen[*ckEpisode] = true
		if cur, err = s.episode(ctx, *ckEpisode); errors.Is(err, ErrNotFound) {
			break
		} else if err != nil {
			return nil, err
		}
	}
	t := &Trajectory{Episode: ep}
	for i := len(path) - 1; i >= 0; i-- {
		steps, err := s.steps(ctx, path[i].episode, path[i].limit)
		if err != nil {
			return nil, err
		}
		for _, st := range steps {
			t.Steps = append(t.Steps, TrajectoryStep{StepRow: st, Inherited: i > 0})
		}
	}
	if t.Rewards, err = s.rewards(ctx, episodeID); err != nil {
		return nil, err
	}
	return t, nil
}

const stepCols = `episode_id, idx, action, observation, observation_size, observation_sha256, reward,
	terminated, truncated, started_at, duration_ns, coalesce(checkpoint_id, ''), setup`

func (s *Store) steps(ctx context.Context, episodeID string, limit int) ([]StepRow, error) {
	if limit < 0 {
		limit = math.MaxInt32
	}
	rows, err := s.pool.Query(ctx, "SELECT "+stepCols+" FROM steps WHERE episode_id = $1 AND idx < $2 ORDER BY idx", episodeID, limit)
	if err != nil {
		return nil, fmt.Errorf("reading steps of %s: %w", episodeID, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (StepRow, error) {
		var st StepRow
		var idx int32
		var dur int64
		var action []byte
		err := r.Scan(&st.EpisodeID, &idx, &action, &st.Observation, &st.ObservationSize, &st.ObservationSHA256,
			&st.Reward, &st.Terminated, &st.Truncated, &st.StartedAt, &dur, &st.CheckpointID, &st.Setup)
		st.Index, st.Duration, st.Action, st.StartedAt = int(idx), time.Duration(dur), json.RawMessage(action), st.StartedAt.UTC()
		return st, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading steps of %s: %w", episodeID, err)
	}
	return out, nil
}

func (s *Store) rewards(ctx context.Context, episodeID string) ([]RewardRow, error) {
	rows, err := s.pool.Query(ctx, `SELECT episode_id, step_index, source, components, value, created_at
		FROM rewards WHERE episode_id = $1 ORDER BY id`, episodeID)
	if err != nil {
		return nil, fmt.Errorf("reading rewards of %s: %w", episodeID, err)
	}
	out, err := collectRewards(rows)
	if err != nil {
		return nil, fmt.Errorf("reading rewards of %s: %w", episodeID, err)
	}
	return out, nil
}

// EpisodeRewards returns the rewards recorded for each of the episodes, in the order they were
// recorded, by episode ID; an episode without rewards has no entry. One query serves a whole
// page of ListEpisodes.
func (s *Store) EpisodeRewards(ctx context.Context, episodeIDs []string) (map[string][]RewardRow, error) {
	out := map[string][]RewardRow{}
	if len(episodeIDs) == 0 {
		return out, nil
	}
	if err := s.flush(ctx); err != nil {
		return nil, err
	}
	rows, err := s.pool.Query(ctx, `SELECT episode_id, step_index, source, components, value, created_at
		FROM rewards WHERE episode_id = ANY($1) ORDER BY id`, episodeIDs)
	if err != nil {
		return nil, fmt.Errorf("reading rewards of %d episodes: %w", len(episodeIDs), err)
	}
	rs, err := collectRewards(rows)
	if err != nil {
		return nil, fmt.Errorf("reading rewards of %d episodes: %w", len(episodeIDs), err)
	}
	for _, r := range rs {
		out[r.EpisodeID] = append(out[r.EpisodeID], r)
	}
	return out, nil
}

func collectRewards(rows pgx.Rows) ([]RewardRow, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (RewardRow, error) {
		var rw RewardRow
		var step *int32
		err := r.Scan(&rw.EpisodeID, &step, &rw.Source, &rw.Components, &rw.Value, &rw.CreatedAt)
		if step != nil {
			i := int(*step)
			rw.StepIndex = &i
		}
		if len(rw.Components) == 0 {
			rw.Components = nil
		}
		rw.CreatedAt = rw.CreatedAt.UTC()
		return rw, err
	})
}

// CheckpointNode is a checkpoint in a tree, with the checkpoints descending from it.
type CheckpointNode struct {
	CheckpointRow
	// ParentIDs are the checkpoints it was reached from: ParentID first, then the extra links
	// (CheckpointEdge) in the order they were recorded, every one of them, including links
	// that close a cycle (a sandbox that went back to a state it had been in).
	ParentIDs []string `json:"parent_ids,omitempty"`
	// Digest is its state digest; zero until recorded.
	Digest Digest `json:"digest"`
	// Children are the checkpoints placed under it in the forest, in creation order: each node
	// is under one parent, the first of its parents in the set that comes before it in
	// CheckpointGraph's order, so walking them visits every node once.
	Children []*CheckpointNode `json:"children,omitempty"`
}

// CheckpointTree returns the forest of CheckpointGraph: its roots, each node under the first of
// its parents in the set that comes before it.
func (s *Store) CheckpointTree(ctx context.Context, run, episode string) ([]*CheckpointNode, error) {
	nodes, err := s.CheckpointGraph(ctx, run, episode)
	if err != nil {
		return nil, err
	}
	var roots []*CheckpointNode
	for _, n := range nodes {
		if !n.placed {
			roots = append(roots, &n.CheckpointNode)
		}
	}
	return roots, nil
}

// GraphNode is a node of CheckpointGraph's answer.
type GraphNode struct {
	CheckpointNode
	placed bool // under a parent's Children
}

const graphCols = `n.id, coalesce(n.parent_id, ''), n.kind, n.env, n.sandbox, coalesce(n.episode_id, ''), coalesce(n.step_index, 0),
	n.created_at, n.released_at, coalesce(d.files, ''), coalesce(d.processes, '')`

// graphRunQuery selects the checkpoints of a run's graph: those taken in its episodes or that
// they started from (seed0), those their edges lead to (seed), and the ancestors of all by
// parent_id. The recursion carries ids alone (UNION compares those, not whole rows) and joins
// by the primary key; where Postgres hashes checkpoints for it, the hash is built once per
// query, not per step. UNION keeps each checkpoint once, so it ends even on a cycle.
const graphRunQuery = `WITH RECURSIVE seed0 AS (
		SELECT c.id FROM checkpoints c JOIN episodes e ON c.episode_id = e.id WHERE e.run = $1
		UNION SELECT start_checkpoint FROM episodes WHERE run = $1 AND start_checkpoint IS NOT NULL
	), seed AS (
		SELECT id FROM seed0
		UNION SELECT e.child_id FROM checkpoint_edges e WHERE e.parent_id IN (SELECT id FROM seed0)
	), anc (id, parent_id) AS (
		SELECT c.id, c.parent_id FROM checkpoints c WHERE c.id IN (SELECT id FROM seed)
		UNION SELECT p.id, p.parent_id FROM anc JOIN checkpoints p ON p.id = anc.parent_id
	) SELECT ` + graphCols + ` FROM anc JOIN checkpoints n ON n.id = anc.id LEFT JOIN checkpoint_digests d ON d.id = n.id`

// graphEpisodeQuery selects the checkpoints of an episode's graph: those it took or started
// from and their ancestors by parent_id (anc), and every checkpoint descending from the ones
// it took by either link (des). Each step of a recursion looks its rows' neighbours up by index
// (checkpoints by primary key and by parent_id, checkpoint_edges by parent_id), so its cost
// follows the rows it reaches, not the size of the tables; UNION keeps each checkpoint once,
// so a cycle of edges ends the descent rather than looping.
const graphEpisodeQuery = `WITH RECURSIVE seed AS (
		SELECT id FROM checkpoints WHERE episode_id = $1
		UNION SELECT start_checkpoint FROM episodes WHERE id = $1 AND start_checkpoint IS NOT NULL
	), anc (id, parent_id) AS (
		SELECT c.id, c.parent_id FROM checkpoints c WHERE c.id IN (SELECT id FROM seed)
		UNION SELECT p.id, p.parent_id FROM anc JOIN checkpoints p ON p.id = anc.parent_id
	), des (id) AS (
		SELECT id FROM checkpoints WHERE episode_id = $1
		UNION SELECT l.id FROM des CROSS JOIN LATERAL (
			SELECT c.id FROM checkpoints c WHERE c.parent_id = des.id
			UNION ALL SELECT e.child_id FROM checkpoint_edges e WHERE e.parent_id = des.id
		) l
	), g AS (
		SELECT id FROM anc UNION SELECT id FROM des
	) SELECT ` + graphCols + ` FROM g JOIN checkpoints n ON n.id = g.id LEFT JOIN checkpoint_digests d ON d.id = n.id`

// CheckpointGraph returns the checkpoint graph of a run (every checkpoint taken in its episodes
// or that they started from, the ones a deduplicating checkpoint of theirs found, and their
// ancestors) or, if episode is set, of one episode (the checkpoints it took and started from,
// their ancestors, and every checkpoint descending from the ones it took, by either kind of
// parent link).
//
// The graph is directed and may have cycles: a checkpoint's own parent_id is always older than
// it, but an extra link may come from a newer checkpoint, and one from a descendant when a
// sandbox went back to a state it had passed through (an undo). Every link is in ParentIDs.
// The nodes come parents before children along parent_id (the tree of first parents, which is
// acyclic) and along each extra link that closes no cycle with the links recorded before it:
// the depth-first order of the forest (children in creation order) in which a checkpoint with
// several such parents in the set comes right after the last of them.
func (s *Store) CheckpointGraph(ctx context.Context, run, episode string) ([]*GraphNode, error) {
	if (run == "") == (episode == "") {
		return nil, fmt.Errorf("checkpoint tree needs exactly one of run and episode: %w", ErrInvalid)
	}
	if err := errors.Join(checkText("run", run), checkText("episode_id", episode)); err != nil {
		return nil, err
	}
	if err := s.flush(ctx); err != nil {
		return nil, err
	}
	q, arg := graphRunQuery, run
	if episode != "" {
		q, arg = graphEpisodeQuery, episode
		if _, err := s.episode(ctx, episode); err != nil {
			return nil, err
		}
	}
	rows, err := s.pool.Query(ctx, q, arg)
	if err != nil {
		return nil, fmt.Errorf("reading checkpoint tree: %w", err)
	}
	nodes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*GraphNode, error) {
		n := &GraphNode{}
		var kind string
		var step int32
		err := r.Scan(&n.ID, &n.ParentID, &kind, &n.Env, &n.Sandbox, &n.EpisodeID, &step, &n.CreatedAt, &n.ReleasedAt,
			&n.Digest.Files, &n.Digest.Processes)
		n.Kind, n.StepIndex, n.CreatedAt = CheckpointKind(kind), int(step), n.CreatedAt.UTC()
		return n, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading checkpoint tree: %w", err)
	}
	ids := make([]string, len(nodes))
	for i, n := range nodes {
		ids[i] = n.ID
	}
	rows, err = s.pool.Query(ctx, `SELECT child_id, parent_id, created_at FROM checkpoint_edges WHERE child_id = ANY($1)
		ORDER BY created_at, parent_id`, ids)
	if err != nil {
		return nil, fmt.Errorf("reading checkpoint graph edges: %w", err)
	}
	edges, err := pgx.CollectRows(rows, pgx.RowToStructByPos[CheckpointEdge])
	if err != nil {
		return nil, fmt.Errorf("reading checkpoint graph edges: %w", err)
	}
	return orderGraph(nodes, edges), nil
}

// orderGraph links nodes by their parent_id and by edges (in order, every one in ParentIDs;
// those that would close a cycle not followed for the order) and returns them parents before
// children (CheckpointGraph).
func orderGraph(nodes []*GraphNode, edges []CheckpointEdge) []*GraphNode {
	slices.SortFunc(nodes, func(a, b *GraphNode) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
	})
	index := make(map[string]int32, len(nodes))
	for i, n := range nodes {
		index[n.ID] = int32(i)
	}
	out, pending := linkGraph(nodes, index, edges)
	order := walkGraph(nodes, out, pending)
	// The forest: each node under the first of its parents in the set that comes before it,
	// so that a link closing a cycle never makes a node its own ancestor in the forest.
	pos := make([]int, len(nodes))
	for i, n := range order {
		pos[index[n.ID]] = i
	}
	for i, n := range order {
		for _, pid := range n.ParentIDs {
			if p, ok := index[pid]; ok && pos[p] < i {
				nodes[p].Children = append(nodes[p].Children, &n.CheckpointNode)
				n.placed = true
				break
			}
		}
	}
	for _, n := range nodes {
		slices.SortStableFunc(n.Children, func(a, b *CheckpointNode) int {
			return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
		})
	}
	return order
}

// linkGraph sets the nodes' ParentIDs and returns, by index in nodes (creation order), each
// node's children in the set by the links the order follows (parent_id, and each edge that
// closes no cycle with those before it), in creation order, and how many such parents in the
// set each has.
func linkGraph(nodes []*GraphNode, index map[string]int32, edges []CheckpointEdge) ([][]int32, []int32) {
	out := make([][]int32, len(nodes))
	in := make([][]int32, len(nodes))
	pending := make([]int32, len(nodes))
	for i, n := range nodes {
		if n.ParentID != "" {
			n.ParentIDs = append(n.ParentIDs, n.ParentID)
		}
		if p, ok := index[n.ParentID]; ok && p != int32(i) {
			out[p] = append(out[p], int32(i))
			in[i] = append(in[i], p)
			pending[i]++
		}
	}
	if len(edges) == 0 {
		return out, pending
	}
	t := newTopo(walkGraph(nodes, out, slices.Clone(pending)), index, out, in)
	extra := false
	for _, e := range edges {
		c, ok := index[e.ChildID]
		if !ok || slices.Contains(nodes[c].ParentIDs, e.ParentID) {
			continue
		}
		nodes[c].ParentIDs = append(nodes[c].ParentIDs, e.ParentID)
		if p, ok := index[e.ParentID]; ok && p != c && t.link(p, c) {
			pending[c]++
			extra = true
		} // else outside the set, or a cycle: the state came back to where it had been
	}
	if extra {
		for _, cs := range out {
			slices.Sort(cs)
		}
	}
	return out, pending
}

// walkGraph returns the nodes parents before children (CheckpointGraph's order), consuming
// pending.
func walkGraph(nodes []*GraphNode, out [][]int32, pending []int32) []*GraphNode {
	order := make([]*GraphNode, 0, len(nodes))
	// Depth first from each root, a node once the last of its parents is out: an explicit
	// stack, as a chain of checkpoints may be as long as a run.
	var roots, stack []int32
	for r := range nodes {
		if pending[r] == 0 {
			roots = append(roots, int32(r))
		}
	}
	for _, r := range roots {
		stack = append(stack[:0], r)
		for len(stack) > 0 {
			n := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			order = append(order, nodes[n])
			cs := out[n]
			for i := len(cs) - 1; i >= 0; i-- {
				if pending[cs[i]]--; pending[cs[i]] == 0 {
					stack = append(stack, cs[i])
				}
			}
		}
	}
	return order
}

// topo keeps a topological order of the links followed so far as links are added (the dynamic
// topological sort of Pearce and Kelly): a link along the order changes nothing, and one
// against it is checked by a search confined to the nodes placed between its two ends, so the
// check of a link costs the span it crosses, not the graph.
type topo struct {
	out, in [][]int32 // the links followed, by node index
	place   []int32   // each node's place in the order
	mark    []uint32  // visited in search number seen
	seen    uint32
	fwd     []int32 // reached from the child
	bwd     []int32 // reaching the parent
	stack   []int32
	places  []int32
}

// newTopo starts from order, a topological order of the links in out and in.
func newTopo(order []*GraphNode, index map[string]int32, out, in [][]int32) *topo {
	t := &topo{out: out, in: in, place: make([]int32, len(out)), mark: make([]uint32, len(out))}
	for i, n := range order {
		t.place[index[n.ID]] = int32(i)
	}
	return t
}

// link follows p→c and says so, unless c reaches p by the links followed (it would close a
// cycle).
func (t *topo) link(p, c int32) bool {
	lo, hi := t.place[c], t.place[p]
	if hi < lo {
		t.out[p], t.in[c] = append(t.out[p], c), append(t.in[c], p)
		return true
	}
	t.seen++
	// Forward from c through the nodes placed before p: reaching p closes a cycle.
	t.fwd = t.search(t.fwd[:0], c, t.out, func(n int32) bool { return t.place[n] <= hi })
	if t.mark[p] == t.seen {
		return false
	}
	// Back from p through the nodes placed after c; none of them is in fwd, else c would
	// reach p. Those reaching p move before those c reaches, in the places both held.
	t.bwd = t.search(t.bwd[:0], p, t.in, func(n int32) bool { return t.place[n] > lo })
	byPlace := func(a, b int32) int { return cmp.Compare(t.place[a], t.place[b]) }
	slices.SortFunc(t.fwd, byPlace)
	slices.SortFunc(t.bwd, byPlace)
	t.places = t.places[:0]
	for _, n := range t.bwd {
		t.places = append(t.places, t.place[n])
	}
	for _, n := range t.fwd {
		t.places = append(t.places, t.place[n])
	}
	slices.Sort(t.places)
	for i, n := range append(t.bwd, t.fwd...) {
		t.place[n] = t.places[i]
	}
	t.out[p], t.in[c] = append(t.out[p], c), append(t.in[c], p)
	return true
}

// search appends to into the nodes reached from start by links (start included), going only
// through nodes within says are in range, and marks them seen.
func (t *topo) search(into []int32, start int32, links [][]int32, within func(int32) bool) []int32 {
	t.mark[start] = t.seen
	t.stack = append(t.stack[:0], start)
	for len(t.stack) > 0 {
		n := t.stack[len(t.stack)-1]
		t.stack = t.stack[:len(t.stack)-1]
		into = append(into, n)
		for _, m := range links[n] {
			if t.mark[m] != t.seen && within(m) {
				t.mark[m] = t.seen
				t.stack = append(t.stack, m)
			}
		}
	}
	return into
}

// ReportReward records a reward synchronously (typically one computed by a trainer, with its
// source name). The episode must exist.
//
// A source or component name that is not UTF-8 text without NUL is refused (ErrInvalid): the
// caller chose it, and the ledger cannot hold it.
func (s *Store) ReportReward(ctx context.Context, r RewardRow) error {
	if err := r.validate(); err != nil {
		return err
	}
	if err := checkText("source", r.Source); err != nil {
		return err
	}
	for name := range r.Components {
		if err := checkText("reward name", name); err != nil {
			return err
		}
	}
	if r.CreatedAt.IsZero() {
		r.CreatedAt = time.Now()
	}
	if err := s.flush(ctx); err != nil {
		return err
	}
	if _, err := s.episode(ctx, r.EpisodeID); err != nil {
		return err
	}
	if _, err := s.pool.Exec(ctx, insertReward, rewardValues(&r)...); err != nil {
		return fmt.Errorf("recording reward of %s: %w", r.EpisodeID, err)
	}
	return nil
}

// ExportedEpisode is one line of a JSONL export.
type ExportedEpisode struct {
	Episode Episode        `json:"episode"`
	Steps   []ExportedStep `json:"steps"`
	Rewards []RewardRow    `json:"rewards"`
}

// ExportedStep is a step as exported: its observation as JSON where ExportOptions.Observation
// could turn it (else null), and the stored bytes (base64) where it could not.
type ExportedStep struct {
	StepRow
	Observation    json.RawMessage `json:"observation"`
	ObservationRaw []byte          `json:"observation_raw,omitempty"`
	// ObservationTruncated says the stored observation was cut at Config.ObservationCap:
	// ObservationSize and ObservationSHA256 are the full one's.
	ObservationTruncated bool `json:"observation_truncated,omitempty"`
}

// ExportOptions selects and shapes an export.
type ExportOptions struct {
	Run string // "" for every run
	// Observation, if set, turns a stored observation into the JSON the export shows (false if
	// it cannot). One that was cut (ExportedStep.ObservationTruncated) is given to it too: the
	// episode core cuts an observation's bulk, not its bytes, so that it decodes, while a prefix
	// cut at Config.ObservationCap may not.
	Observation func(stored []byte) (json.RawMessage, bool)
}

// Export writes the episodes of run (every run when run is ""), as ExportWith does with its
// observations' bytes only.
func (s *Store) Export(ctx context.Context, w io.Writer, run string) error {
	return s.ExportWith(ctx, w, ExportOptions{Run: run})
}

// ExportWith writes the episodes o selects, one JSON object per line, each with its own steps
// (not inherited ones) and rewards, ordered by run and start time.
func (s *Store) ExportWith(ctx context.Context, w io.Writer, o ExportOptions) error {
	if err := checkText("run", o.Run); err != nil {
		return err
	}
	if err := s.flush(ctx); err != nil {
		return err
	}
	q := "SELECT " + episodeCols + " FROM episodes WHERE ($1 = '' OR run = $1) ORDER BY run, started_at, id"
	rows, err := s.pool.Query(ctx, q, o.Run)
	if err != nil {
		return fmt.Errorf("exporting episodes: %w", err)
	}
	eps, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Episode, error) { return scanEpisode(r) })
	if err != nil {
		return fmt.Errorf("exporting episodes: %w", err)
	}
	enc := json.NewEncoder(w)
	for _, e := range eps {
		line := ExportedEpisode{Episode: e, Steps: []ExportedStep{}}
		steps, err := s.steps(ctx, e.ID, -1)
		if err != nil {
			return err
		}
		for _, st := range steps {
			x := ExportedStep{StepRow: st, ObservationTruncated: int64(len(st.Observation)) < st.ObservationSize}
			if o.Observation != nil {
				if j, ok := o.Observation(st.Observation); ok {
					x.Observation = j
				}
			}
			if x.Observation == nil {
				x.ObservationRaw = st.Observation
			}
			line.Steps = append(line.Steps, x)
		}
		if line.Rewards, err = s.rewards(ctx, e.ID); err != nil {
			return err
		}
		if line.Rewards == nil {
			line.Rewards = []RewardRow{}
		}
		if err := enc.Encode(&line); err != nil {
			return fmt.Errorf("writing export: %w", err)
		}
	}
	return nil
}
