// ErrorLine shows an error the API answered, as a message.
export function ErrorLine({ error, id }) {
  if (!error) return null;
  return (
    <p class="error" role="alert" id={id}>
      {error.message || String(error)}
    </p>
  );
}

// shortId shortens an ID for a table cell; the whole ID is in the element's title.
export function shortId(id) {
  if (!id) return '';
  return id.length > 14 ? `${id.slice(0, 12)}…` : id;
}

// timeOf renders an RFC 3339 time as the local time of day.
export function timeOf(ts) {
  if (!ts) return '';
  const d = new Date(ts);
  return Number.isNaN(d.getTime()) ? ts : d.toLocaleTimeString();
}

// fmt renders a number with three significant decimals, or a dash.
export function fmt(x) {
  if (x === null || x === undefined || Number.isNaN(x)) return '–';
  return Number(x).toFixed(3).replace(/\.?0+$/, '') || '0';
}

// statusName shortens an EpisodeStatus name.
export function statusName(s) {
  return (s || 'EPISODE_STATUS_UNSPECIFIED').replace('EPISODE_STATUS_', '').toLowerCase();
}
