// llmgw admin pages: refresh in place. Plain JS, no build step, no dependencies.
"use strict";

const REFRESH_MS = 3000;
const FOLLOW_MS = 2000;

function drawBars(root) {
  for (const fill of root.querySelectorAll(".bar .fill[data-width]")) {
    fill.style.width = fill.dataset.width + "%";
  }
}

async function refresh(live) {
  try {
    const response = await fetch(live.dataset.refresh, { credentials: "same-origin" });
    if (response.status === 401) {
      window.location.assign("/admin/login");
      return;
    }
    if (!response.ok) return;
    live.innerHTML = await response.text();
    drawBars(live);
  } catch (err) {
    // The control plane restarting: try again next time.
  }
}

// Appends what `tail` has that `shown` has not: the longest end of `shown` that
// starts `tail` is what both hold.
function newLines(shown, tail) {
  for (let k = Math.min(shown.length, tail.length); k > 0; k--) {
    let same = true;
    for (let i = 0; i < k; i++) {
      if (shown[shown.length - k + i] !== tail[i]) { same = false; break; }
    }
    if (same) return tail.slice(k);
  }
  return tail;
}

function follow(pre, checkbox) {
  let shown = pre.textContent.split("\n").filter((line, i, all) => i < all.length - 1 || line !== "");
  const error = document.getElementById("log-error");
  async function poll() {
    if (!checkbox.checked) return;
    try {
      const response = await fetch(pre.dataset.follow, { credentials: "same-origin" });
      if (response.status === 401) {
        window.location.assign("/admin/login");
        return;
      }
      if (!response.ok) return;
      const body = await response.json();
      if (error) {
        error.hidden = !body.error;
        error.textContent = body.error || "";
      }
      const fresh = newLines(shown, body.lines);
      if (fresh.length) {
        pre.append(document.createTextNode(fresh.join("\n") + "\n"));
        shown = shown.concat(fresh).slice(-2000);
        pre.scrollTop = pre.scrollHeight;
      }
    } catch (err) {
      // The control plane restarting: try again next time.
    }
  }
  setInterval(poll, FOLLOW_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  drawBars(document);
  for (const live of document.querySelectorAll("[data-refresh]")) {
    setInterval(() => refresh(live), REFRESH_MS);
  }
  const pre = document.querySelector("pre#log[data-follow]");
  const checkbox = document.getElementById("follow");
  if (pre && checkbox) follow(pre, checkbox);
  const node = document.getElementById("node");
  if (node) {
    node.addEventListener("change", () => {
      const source = document.getElementById("source");
      if (source) source.value = "";
      node.form.submit();
    });
  }
  const model = document.getElementById("model");
  if (model) model.addEventListener("change", () => model.form.submit());
});
